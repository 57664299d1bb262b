//! Persistent worker threads for [`Driver::Threads`](super::Driver::Threads) and
//! [`Driver::IssueThreads`](super::Driver::IssueThreads) backends: a flush
//! with several streams runs each extra stream on a worker that outlives the flush, instead of
//! starting a thread every time.
//!
//! [`run_all`] lends the workers closures that borrow the caller's stack. That is sound only if
//! it returns (or unwinds) after every lent closure has finished; a guard that waits for them in
//! its `Drop` makes that hold on every path out of the function, a panic included, exactly as
//! scoped threads do.

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

type Task = Box<dyn FnOnce() + Send + 'static>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counts the tasks of one `run_all` call that have not finished.
#[derive(Default)]
struct Latch {
    left: Mutex<usize>,
    cv: Condvar,
}

impl Latch {
    fn add(&self) {
        *lock(&self.left) += 1;
    }

    fn done(&self) {
        let mut left = lock(&self.left);
        *left -= 1;
        if *left == 0 {
            self.cv.notify_all();
        }
    }

    fn wait(&self) {
        let mut left = lock(&self.left);
        while *left > 0 {
            left = self.cv.wait(left).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Waits for every task handed out so far when dropped: on return and on unwinding alike.
struct JoinOnDrop(Arc<Latch>);

impl Drop for JoinOnDrop {
    fn drop(&mut self) {
        self.0.wait();
    }
}

/// Idle workers, each waiting for one task at a time.
static IDLE: Mutex<Vec<Sender<Task>>> = Mutex::new(Vec::new());

/// A worker: takes a task from its channel, runs it, offers itself again. `None` when the
/// system refuses a new thread.
fn worker() -> Option<Sender<Task>> {
    let (tx, rx) = channel::<Task>();
    let me = tx.clone();
    std::thread::Builder::new()
        .name("braid-stream".into())
        .spawn(move || {
            while let Ok(task) = rx.recv() {
                task();
                lock(&IDLE).push(me.clone());
            }
        })
        .ok()?;
    Some(tx)
}

/// Runs `bodies[0]` on this thread and every other body on a worker, and returns when all have
/// finished. A panicking body is caught (stream bodies report their own failures). If no thread
/// can be had for a body, `no_thread` is called first (it must make every body return soon:
/// failing the flush does) and the body then runs here.
pub(super) fn run_all(bodies: &[Box<dyn Fn() + Sync + '_>], no_thread: &dyn Fn()) {
    let Some((first, rest)) = bodies.split_first() else { return };
    let latch = Arc::new(Latch::default());
    // Declared before any task is handed out, so it is dropped (and waits) after the last one.
    let join = JoinOnDrop(latch.clone());
    for body in rest {
        let f: &(dyn Fn() + Sync) = body.as_ref();
        // SAFETY: `f` is only called before `join` is dropped, which waits until every task
        // counted in the latch has finished; `join` is dropped when this function returns or
        // unwinds, so the borrow outlives every use, as with a scoped thread.
        let f: &'static (dyn Fn() + Sync) = unsafe { std::mem::transmute(f) };
        latch.add();
        let l = latch.clone();
        let task: Task = Box::new(move || {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            l.done();
        });
        let idle = lock(&IDLE).pop();
        match idle.or_else(worker) {
            // A worker that is gone hands the task back: run it here.
            Some(tx) => {
                if let Err(e) = tx.send(task) {
                    (e.0)();
                }
            }
            // No thread to be had: the bodies could wait for one another forever, so they are
            // told to stop first.
            None => {
                no_thread();
                task();
            }
        }
    }
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(first.as_ref()));
    drop(join);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_body_runs_once_and_borrows_stay_valid() {
        let count = AtomicUsize::new(0);
        for n in 1..6 {
            count.store(0, Ordering::SeqCst);
            let bodies: Vec<Box<dyn Fn() + Sync + '_>> = (0..n)
                .map(|_| {
                    Box::new(|| {
                        count.fetch_add(1, Ordering::SeqCst);
                    }) as _
                })
                .collect();
            run_all(&bodies, &|| ());
            assert_eq!(count.load(Ordering::SeqCst), n);
        }
    }

    #[test]
    fn a_panicking_body_is_waited_for_and_does_not_unwind_the_caller() {
        let finished = AtomicUsize::new(0);
        let bodies: Vec<Box<dyn Fn() + Sync + '_>> = vec![
            Box::new(|| panic!("first")),
            Box::new(|| {
                std::thread::sleep(std::time::Duration::from_millis(20));
                finished.fetch_add(1, Ordering::SeqCst);
            }),
            Box::new(|| panic!("third")),
        ];
        run_all(&bodies, &|| ());
        // The slow body had finished before run_all returned.
        assert_eq!(finished.load(Ordering::SeqCst), 1);
    }
}
