//! `kubectl dlq ls --grep/--where`: the records in scope read a page at a time (queue and
//! phase still selected by the apiserver), each page matched by [`crate::search`] while the
//! next one is on its way (`crate::paged`), and the matches printed as they are found. Memory
//! stays bounded by three pages (and the matches themselves with `-o json|yaml`).

use std::time::Instant;

use kube::{Api, Client};

use dlq_core::api::DeadLetter;

use crate::inspect::{
    LsArgs, Output, header, ls_params, print_list, queue_masks, row, sort, table,
};
use crate::paged::pages;
use crate::search::{Masks, Search, Unsearched};
use crate::session::{CliError, Global, connect};

/// `ls` with a search: matches as table rows (with a MATCH column: where and an excerpt, masked)
/// or as records with `-o json|yaml`; on stderr, how many were searched and what was not.
pub async fn run(g: &Global, args: LsArgs) -> Result<(), CliError> {
    let search = Search::parse(args.grep.as_deref(), &args.wheres)
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let (client, ns) = connect(g).await?;
    let namespace = (!g.all_namespaces).then_some(ns.as_str());
    let masks = if search.reads_payload() {
        queue_masks(&client, namespace).await
    } else {
        Masks::default()
    };
    let started = Instant::now();
    let mut pages = pages(records_api(&client, namespace), ls_params(&args));
    let mut scan = Scan::default();
    let mut collected = Vec::new();
    while let Some(page) = pages.recv().await {
        let mut items = page?;
        sort(&mut items);
        let found = scan.page(&search, &masks, items, args.limit);
        match args.output {
            Output::Table => print_found(g, &args, &found, scan.matched == found.len()),
            Output::Json | Output::Yaml => collected.extend(found.into_iter().map(|(r, _)| r)),
        }
        if scan.stopped {
            break;
        }
    }
    drop(pages);
    if args.output != Output::Table {
        print_list(&collected, args.output)?;
    }
    eprintln!("{}", scan.summary(args.limit, started));
    Ok(())
}

fn records_api(client: &Client, namespace: Option<&str>) -> Api<DeadLetter> {
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Where a scan stands: records read, matched, what could not be searched.
#[derive(Default)]
struct Scan {
    scanned: usize,
    matched: usize,
    unsearched: Unsearched,
    /// `--limit` matches were found.
    stopped: bool,
}

impl Scan {
    /// The matches of one page, up to what `limit` (0: no limit) leaves.
    fn page(
        &mut self,
        search: &Search,
        masks: &Masks,
        items: Vec<DeadLetter>,
        limit: usize,
    ) -> Vec<(DeadLetter, String)> {
        let mut found = Vec::new();
        for r in items {
            if limit != 0 && self.matched >= limit {
                self.stopped = true;
                break;
            }
            self.scanned += 1;
            self.unsearched.note(search, &r);
            if let Some(hit) = search.find(&r, masks.of(&r)) {
                self.matched += 1;
                found.push((r, hit.line()));
            }
        }
        if limit != 0 && self.matched >= limit {
            self.stopped = true;
        }
        found
    }

    /// The stderr line: how many matched of how many, how long, and what was not searched.
    fn summary(&self, limit: usize, started: Instant) -> String {
        let secs = started.elapsed().as_secs_f64();
        let (matched, scanned) = (self.matched, self.scanned);
        let mut out = if self.stopped {
            format!(
                "{matched} matches in the first {scanned} records ({secs:.1} s); stopped at \
                 --limit {limit} (--limit 0 searches every record)"
            )
        } else {
            format!("{matched} of {scanned} records match ({secs:.1} s)")
        };
        if let Some(more) = self.unsearched.describe() {
            out.push_str("; ");
            out.push_str(&more);
        }
        out
    }
}

/// One page of matches as table rows (the `ls` row and MATCH); the header above the first.
fn print_found(g: &Global, args: &LsArgs, found: &[(DeadLetter, String)], first: bool) {
    let mut rows = Vec::new();
    if first && !args.no_headers && !found.is_empty() {
        let mut h = header(g.all_namespaces);
        h.push("MATCH".into());
        rows.push(h);
    }
    rows.extend(found.iter().map(|(r, hit)| {
        let mut cells = row(r, g.all_namespaces);
        cells.push(hit.clone());
        cells
    }));
    if !rows.is_empty() {
        print!("{}", table(&rows));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlq_core::api::Job;

    fn record(id: &str, payload: &str) -> DeadLetter {
        let req =
            dlq_core::park::ParkRequest::new("relayer", Job::from_bytes(id, payload.as_bytes()));
        dlq_core::park::new_record(&req, 1)
    }

    #[test]
    fn a_scan_counts_matches_and_stops_at_the_limit() {
        let search = Search::parse(Some("cus_42"), &[]).expect("a search");
        let page = || {
            (0..10)
                .map(|i| {
                    record(
                        &format!("j{i}"),
                        if i % 2 == 0 { "cus_42" } else { "cus_7" },
                    )
                })
                .collect::<Vec<_>>()
        };
        let mut all = Scan::default();
        assert_eq!(all.page(&search, &Masks::default(), page(), 0).len(), 5);
        assert_eq!(all.page(&search, &Masks::default(), page(), 0).len(), 5);
        assert_eq!((all.scanned, all.matched, all.stopped), (20, 10, false));
        let mut some = Scan::default();
        let found = some.page(&search, &Masks::default(), page(), 3);
        assert_eq!(found.len(), 3);
        assert!(some.stopped);
        assert_eq!(found[0].1, "payload: cus_42");
        let said = some.summary(3, Instant::now());
        assert!(
            said.starts_with("3 matches in the first 5 records"),
            "{said}"
        );
    }
}
