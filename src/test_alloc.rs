//! The unit tests' allocator: the system's, counting the bytes each thread holds and the most
//! it held, so a test on a current-thread runtime can bound what one operation holds at once.
//! Per thread, so tests running beside it do not count.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    static HELD: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

struct Counting;

fn count(delta: isize) {
    // `try_with`: a thread being torn down still allocates; it is not counted.
    let _ = HELD.try_with(|held| {
        let now = held.get() + delta;
        held.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is passed on to the system allocator unchanged; the counters are
// thread-local cells with constant initialisers, which neither allocate nor run destructors.
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

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Starts a new peak at what this thread holds now.
pub fn reset_peak() {
    let now = HELD.with(Cell::get);
    PEAK.with(|peak| peak.set(now));
}

/// The most this thread held since [`reset_peak`], above what it held then (`from`).
pub fn peak_above(from: isize) -> isize {
    PEAK.with(Cell::get) - from
}

/// What this thread holds now.
pub fn held() -> isize {
    HELD.with(Cell::get)
}
