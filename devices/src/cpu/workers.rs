//! Persistent worker threads for CPU streams: a flush with several streams runs each extra
//! stream on a worker that outlives the flush, instead of starting a thread every time.
//!
//! `run_all` lends the workers closures that borrow the caller's stack and returns only after
//! every one has finished (even if one panicked), which is what makes the borrow sound, exactly
//! as with scoped threads.

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex};

type Task = Box<dyn FnOnce() + Send + 'static>;

/// Counts unfinished tasks of one `run_all` call.
struct Latch {
    left: Mutex<usize>,
    cv: Condvar,
}

impl Latch {
    fn done(&self) {
        let mut left = self.left.lock().unwrap_or_else(|p| p.into_inner());
        *left -= 1;
        if *left == 0 {
            self.cv.notify_all();
        }
    }

    fn wait(&self) {
        let mut left = self.left.lock().unwrap_or_else(|p| p.into_inner());
        while *left > 0 {
            left = self.cv.wait(left).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Idle workers, each waiting for one task at a time.
static IDLE: Mutex<Vec<Sender<Task>>> = Mutex::new(Vec::new());

/// A worker: takes a task from its channel, runs it, offers itself again.
fn worker() -> Sender<Task> {
    let (tx, rx) = channel::<Task>();
    let me = tx.clone();
    std::thread::Builder::new()
        .name("braid-cpu-stream".into())
        .spawn(move || {
            while let Ok(task) = rx.recv() {
                task();
                IDLE.lock().unwrap_or_else(|p| p.into_inner()).push(me.clone());
            }
        })
        .expect("a stream worker thread starts");
    tx
}

/// Runs `first` on this thread and every closure of `rest` on a worker, and returns when all
/// have finished. The closures must not panic (stream bodies catch their own panics).
pub(super) fn run_all<'a>(first: &'a (dyn Fn() + Sync), rest: &[&'a (dyn Fn() + Sync)]) {
    let latch = Arc::new(Latch { left: Mutex::new(rest.len()), cv: Condvar::new() });
    for &f in rest {
        // SAFETY: `f` is only called before `latch.wait()` below returns, and this function does
        // not return (or unwind: `first` is called under catch_unwind) before then, so the borrow
        // outlives every use, as with a scoped thread.
        let f: &'static (dyn Fn() + Sync) = unsafe { std::mem::transmute(f) };
        let l = latch.clone();
        let task: Task = Box::new(move || {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            l.done();
        });
        let tx = IDLE.lock().unwrap_or_else(|p| p.into_inner()).pop().unwrap_or_else(worker);
        if let Err(e) = tx.send(task) {
            // The worker is gone (it cannot be, but never lose a task): run it here.
            (e.0)();
        }
    }
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(first));
    latch.wait();
}
