//! A counting allocator for tests that bound what an operation holds at once (a test binary
//! installs it with `#[global_allocator]`): the system's, counting the bytes held and the most
//! held, for the whole process and for each thread. A test alone in its process reads the
//! process's counts; one on a current-thread runtime beside others reads its thread's.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};

/// The system allocator, counting.
pub struct Counting;

static HELD: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

thread_local! {
    static THREAD_HELD: Cell<isize> = const { Cell::new(0) };
    static THREAD_PEAK: Cell<isize> = const { Cell::new(0) };
}

fn count(delta: isize) {
    let now = HELD.fetch_add(delta, Ordering::Relaxed) + delta;
    PEAK.fetch_max(now, Ordering::Relaxed);
    // `try_with`: a thread being torn down still allocates; it is not counted.
    let _ = THREAD_HELD.try_with(|held| {
        let now = held.get() + delta;
        held.set(now);
        let _ = THREAD_PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is passed on to the system allocator unchanged; the counters are atomics
// and thread-local cells with constant initialisers, which neither allocate nor run destructors.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as isize));
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        count(new as isize - layout.size() as isize);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new) }
    }
}

/// Bytes the process holds now.
pub fn held() -> isize {
    HELD.load(Ordering::Relaxed)
}

/// Starts a new process peak at what it holds now, which it returns.
pub fn start_peak() -> isize {
    let now = held();
    PEAK.store(now, Ordering::Relaxed);
    now
}

/// The most the process held since [`start_peak`] returned `from`, above that.
pub fn peak_above(from: isize) -> isize {
    PEAK.load(Ordering::Relaxed) - from
}

/// The same counts for the calling thread alone.
pub mod thread {
    use super::{THREAD_HELD, THREAD_PEAK};
    use std::cell::Cell;

    /// Starts a new peak of this thread at what it holds now, which it returns.
    pub fn start_peak() -> isize {
        let now = THREAD_HELD.with(Cell::get);
        THREAD_PEAK.with(|peak| peak.set(now));
        now
    }

    /// The most this thread held since [`start_peak`] returned `from`, above that.
    pub fn peak_above(from: isize) -> isize {
        THREAD_PEAK.with(Cell::get) - from
    }
}
