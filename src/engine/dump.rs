//! Inspecting scheduled graphs: [`ScheduleDump`] (what `device.last_schedule()` returns) and
//! dump files (`BRAID_DUMP=DIR` or [`set_dir`]), which every flush writes.
//!
//! Building the text of a dump costs time, so a flush only keeps what it planned; the JSON,
//! text and DOT are produced when first asked for.

use crate::lock;
use braid_devices::Backend;
use braid_graph::{FlushGraph, Op};
use braid_lowering::Kernel;
use braid_scheduler::{Dump, Schedule};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// A flush's kernels and their device, which says each one's launch variant.
pub(crate) type KernelsRan = (Arc<[Arc<Kernel>]>, Weak<dyn Backend>);

/// What a flush planned, kept until its dump is asked for.
struct Live {
    schedule: Arc<Schedule>,
    graph: Arc<FlushGraph>,
    flush: u64,
    device: Arc<str>,
    not_run: Option<String>,
    /// The kernels it ran and their device.
    variants: Option<KernelsRan>,
}

/// The schedule of one flush, as a value: JSON (schema version 1), text and DOT.
#[derive(Clone)]
pub struct ScheduleDump(Arc<Source>);

struct Source {
    live: Option<Live>,
    built: OnceLock<Dump>,
}

impl ScheduleDump {
    /// The dump of a flush that planned `schedule`; `not_run` says why it did not run, if it did
    /// not.
    pub(crate) fn live(
        schedule: Arc<Schedule>,
        graph: Arc<FlushGraph>,
        flush: u64,
        device: Arc<str>,
        not_run: Option<String>,
        variants: Option<KernelsRan>,
    ) -> ScheduleDump {
        let live = Live { schedule, graph, flush, device, not_run, variants };
        ScheduleDump(Arc::new(Source { live: Some(live), built: OnceLock::new() }))
    }

    /// Makes this dump the one of flush `flush`, in place, when it describes the same plan
    /// (`schedule` over `graph`, run) and nobody else holds it: a replayed step publishes a
    /// dump per call, and only its number changes. `false` when a new dump must be made.
    pub(crate) fn renumber(&mut self, schedule: &Arc<Schedule>, graph: &Arc<FlushGraph>, flush: u64) -> bool {
        let Some(source) = Arc::get_mut(&mut self.0) else { return false };
        let Some(live) = &mut source.live else { return false };
        if !Arc::ptr_eq(&live.schedule, schedule) || !Arc::ptr_eq(&live.graph, graph) || live.not_run.is_some() {
            return false;
        }
        live.flush = flush;
        source.built = OnceLock::new();
        true
    }

    /// Reads a dump written as JSON (for example by `BRAID_DUMP`); the error says what is
    /// wrong with the text.
    pub fn from_json(text: &str) -> Result<ScheduleDump, String> {
        let dump = Dump::from_json(text)?;
        Ok(ScheduleDump(Arc::new(Source { live: None, built: OnceLock::from(dump) })))
    }

    /// The dump as data (the JSON schema's fields).
    pub fn dump(&self) -> &Dump {
        self.0.built.get_or_init(|| {
            let live = self.0.live.as_ref().expect("a loaded dump is built already");
            let mut dump = Dump::new(&live.schedule, &live.graph, live.flush, &live.device);
            dump.not_run = live.not_run.clone();
            if let Some((kernels, backend)) = &live.variants
                && let Some(backend) = backend.upgrade()
            {
                let index = |id: &str| id.strip_prefix('k')?.parse::<usize>().ok();
                dump.set_variants(|id| backend.kernel_variant(kernels.get(index(id)?)?));
            }
            dump
        })
    }

    pub fn to_json(&self) -> String {
        self.dump().to_json()
    }

    pub fn to_text(&self) -> String {
        self.dump().to_text()
    }

    pub fn to_dot(&self) -> String {
        self.dump().to_dot()
    }

    /// The flush's sequence number (as in the file name `flush-NNNNNN`). Cheap: it does not
    /// build the dump.
    pub fn flush(&self) -> u64 {
        match &self.0.live {
            Some(live) => live.flush,
            None => self.dump().flush,
        }
    }

    /// Why this flush did not run (a memory budget out of reach, a refused schedule), if it
    /// did not.
    pub fn not_run(&self) -> Option<String> {
        match &self.0.live {
            Some(live) => live.not_run.clone(),
            None => self.dump().not_run.clone(),
        }
    }

    /// Kernels this flush ran.
    pub fn kernel_count(&self) -> usize {
        match &self.0.live {
            Some(live) => live.schedule.kernel_count(),
            None => self.dump().kernel_count(),
        }
    }

    /// Matrix products this flush ran: the `matmul` ops of its kernels, each counted once
    /// (a product fused with elementwise work around it is still one product). 0 when the
    /// flush did not run ([`not_run`](Self::not_run)). A benchmark compares it with the
    /// products its workload has by construction, so that a lazy engine that skipped one (a
    /// gradient nobody held) cannot pass for doing the peer's work.
    ///
    /// ```
    /// use braid::prelude::*;
    /// let dev = Device::new_cpu();
    /// let (a, b) = (Tensor::randn([8, 8], DType::F32, &dev), Tensor::randn([8, 8], DType::F32, &dev));
    /// let y = a.matmul(&b).tanh().matmul(&b).sum();
    /// y.item::<f32>().unwrap();
    /// assert_eq!(dev.last_schedule().unwrap().product_count(), 2);
    /// ```
    pub fn product_count(&self) -> usize {
        if self.not_run().is_some() {
            return 0;
        }
        match &self.0.live {
            Some(live) => live
                .schedule
                .kernels
                .iter()
                .flat_map(|k| &live.schedule.fusion.segments[k.segment].nodes)
                .filter(|&&n| matches!(live.graph.nodes[n].op, Op::Matmul | Op::QuantMatmul(_)))
                .count(),
            None => self.dump().product_count(),
        }
    }

    /// Bytes of the highest simultaneous allocation the plan makes.
    pub fn planned_peak_bytes(&self) -> u64 {
        match &self.0.live {
            Some(live) => live.schedule.planned_peak_bytes,
            None => self.dump().planned_peak_bytes,
        }
    }
}

impl std::fmt::Debug for ScheduleDump {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ScheduleDump(flush {}, {} kernels)", self.flush(), self.kernel_count())
    }
}

/// `Some(dir)` set by [`set_dir`]; `None` inside means "explicitly off".
static DIR_OVERRIDE: Mutex<Option<Option<PathBuf>>> = Mutex::new(None);

/// Makes every flush write `DIR/flush-NNNNNN.{json,txt,dot}` (`None` turns it off; devices
/// after the program's first add their number, see [`file_stem`]). Overrides `BRAID_DUMP`.
pub fn set_dir(dir: Option<PathBuf>) {
    *lock(&DIR_OVERRIDE) = Some(dir);
}

/// Where this flush's dump goes: [`set_dir`]'s choice, else `BRAID_DUMP` (read now).
pub(crate) fn dir() -> Option<PathBuf> {
    if let Some(choice) = lock(&DIR_OVERRIDE).clone() {
        return choice;
    }
    std::env::var_os("BRAID_DUMP").filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// The name (without extension) of the dump files of flush number `flush` on `device`:
/// `flush-NNNNNN` for the first device the program made, `flush-NNNNNN-dK` for its device
/// number K after that, so that devices writing to one directory never overwrite each other's
/// dumps (flush numbers count per device).
pub fn file_stem(device: &crate::Device, flush: u64) -> String {
    stem(device.engine().id, flush)
}

fn stem(device: braid_graph::DeviceId, flush: u64) -> String {
    match device.0 {
        0 => format!("flush-{flush:06}"),
        k => format!("flush-{flush:06}-d{k}"),
    }
}

/// Writes the three files of a dump of `device`; failures are logged, never fatal (a dump must
/// not break the computation it describes).
pub(crate) fn write_files(dir: &std::path::Path, device: braid_graph::DeviceId, dump: &ScheduleDump) {
    let stem = dir.join(stem(device, dump.flush()));
    let result = std::fs::create_dir_all(dir).and_then(|_| {
        std::fs::write(stem.with_extension("json"), dump.to_json())?;
        std::fs::write(stem.with_extension("txt"), dump.to_text())?;
        std::fs::write(stem.with_extension("dot"), dump.to_dot())
    });
    if let Err(e) = result {
        tracing::warn!(target: "braid::dump", "could not write {}: {e}", stem.display());
    }
}
