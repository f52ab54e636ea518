//! What the reconcilers, the sources and the alert sender share, below all of them: the job
//! index sources park with, the record index everyone reads, this replica's leadership, the
//! one writer to the apiserver, the parking priority between sources and marks, and the count
//! behind `--max-records`.

pub mod apiserver;
pub mod bytes;
pub mod ceiling;
pub mod jobs;
pub mod leadership;
pub mod parking_first;
pub mod records;
