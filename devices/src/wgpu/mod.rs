//! The wgpu device: the context (instance, adapter, device, queue) with the adapter's real
//! limits, WGSL kernels compiled into cached pipelines and encoded over given buffers, and
//! buffers with readback (this file, `kernels`, `buffers`); and the runtime's backend over
//! them ([`WgpuBackend`]: `device`, `memory`, `queue`), which runs schedules with every braid
//! stream interleaved on wgpu's one queue (see `queue` for why that keeps every event and
//! gated free of the schedule). Nothing here plans, fuses or reorders.
//!
//! Every wgpu call that can fail runs inside an error scope, so that validation errors (a
//! buffer over the adapter's limit, a shader naga rejects) and out-of-memory come back as
//! `Err(DeviceError)`; the device's uncaptured-error handler only logs, and a lost device
//! makes every later call an `Err(Unavailable)`. Nothing here panics on a run-time failure.
//!
//! Error scopes are per thread, so concurrent calls from several threads each see their own.

mod buffers;
mod device;
mod kernels;
mod memory;
mod queue;
mod tune;

pub use buffers::{run_kernel_on_wgpu, run_printed_on_wgpu};
pub use device::{WgpuBackend, wgpu_target};
pub use kernels::WgslKernel;
pub use memory::WgpuBuffer;

/// wgpu as the engine's registry knows it: `wgpu` (or `wgpu:0`) opens the first adapter of
/// the backends `WGPU_BACKEND` names; the machine counts one device when that adapter opens.
pub fn registration() -> crate::Registration {
    crate::Registration::new("wgpu", |ordinal| match ordinal {
        None | Some(0) => Ok(std::sync::Arc::new(WgpuBackend::open()?)),
        Some(n) => Err(crate::DeviceError::Unavailable(format!(
            "wgpu:{n}: braid's wgpu backend opens the first adapter only (wgpu or wgpu:0)"
        ))),
    })
    .with_count(device::adapter_count)
}

use crate::DeviceError;
use braid_lowering::wgsl::Features;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A wgpu device ready to run braid's kernels.
pub struct WgpuContext {
    pub adapter: wgpu::Adapter,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    /// The limits the device was created with: the adapter's own.
    pub limits: wgpu::Limits,
    /// What the WGSL printer needs to know about the device.
    pub features: Features,
    lost: Arc<AtomicBool>,
    /// 16 zero bytes, bound to every kernel's `Binding::Zero`.
    zero: wgpu::Buffer,
    pipelines: kernels::PipelineCache,
    // Kept so the adapter's instance lives as long as the device.
    _instance: wgpu::Instance,
}

/// Reads one limit.
type LimitOf = fn(&wgpu::Limits) -> u64;

/// The least the printed kernels need (WebGPU's default limits): an adapter below one of these
/// is refused with the limit's name.
const MINIMUM: [(&str, LimitOf, u64); 6] = [
    ("max_storage_buffers_per_shader_stage", |l| l.max_storage_buffers_per_shader_stage as u64, 8),
    ("max_storage_buffer_binding_size", |l| l.max_storage_buffer_binding_size, 128 << 20),
    ("max_compute_workgroups_per_dimension", |l| l.max_compute_workgroups_per_dimension as u64, 65_535),
    ("max_compute_invocations_per_workgroup", |l| l.max_compute_invocations_per_workgroup as u64, 256),
    ("max_compute_workgroup_size_x", |l| l.max_compute_workgroup_size_x as u64, 256),
    ("max_compute_workgroup_storage_size", |l| l.max_compute_workgroup_storage_size as u64, 16_384),
];

impl WgpuContext {
    /// A context on the first adapter of the backends `WGPU_BACKEND` names (every backend
    /// compiled in when unset), preferring a discrete GPU.
    pub fn new() -> Result<WgpuContext, DeviceError> {
        let desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        WgpuContext::with_instance(desc)
    }

    /// A context on the given backends only.
    pub fn with_backends(backends: wgpu::Backends) -> Result<WgpuContext, DeviceError> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        desc.backends = backends;
        WgpuContext::with_instance(desc)
    }

    fn with_instance(desc: wgpu::InstanceDescriptor) -> Result<WgpuContext, DeviceError> {
        let tried = desc.backends & wgpu::Instance::enabled_backend_features();
        if tried.is_empty() {
            return Err(DeviceError::Unavailable(format!(
                "no wgpu adapter: none of the backends asked for ({:?}) is compiled in ({:?})",
                desc.backends,
                wgpu::Instance::enabled_backend_features()
            )));
        }
        let instance = wgpu::Instance::new(desc);
        let options = wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            force_fallback_adapter: false,
            compatible_surface: None,
            // The real limits, not rounded down to buckets (that hides adapters from web content).
            apply_limit_buckets: false,
        };
        let adapter = block_on(instance.request_adapter(&options))?.map_err(|e| {
            DeviceError::Unavailable(format!(
                "no wgpu adapter on the backends tried ({tried:?}): {e} (for a software Vulkan driver, \
                 install mesa-vulkan-drivers and libvulkan1)"
            ))
        })?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        for (name, get, least) in MINIMUM {
            if get(&limits) < least {
                return Err(DeviceError::Unavailable(format!(
                    "wgpu adapter {} ({:?}): its {name} is {}, braid's kernels need at least {least}",
                    info.name,
                    info.backend,
                    get(&limits)
                )));
            }
        }
        let shader_f16 = adapter.features().contains(wgpu::Features::SHADER_F16);
        let required_features = if shader_f16 { wgpu::Features::SHADER_F16 } else { wgpu::Features::empty() };
        let desc = wgpu::DeviceDescriptor {
            label: Some("braid"),
            required_features,
            required_limits: limits.clone(),
            ..Default::default()
        };
        let (device, queue) = block_on(adapter.request_device(&desc))?.map_err(|e| {
            DeviceError::Unavailable(format!("wgpu adapter {} ({:?}) refused a device: {e}", info.name, info.backend))
        })?;
        let lost = Arc::new(AtomicBool::new(false));
        let flag = lost.clone();
        device.set_device_lost_callback(move |reason, message| {
            flag.store(true, Ordering::SeqCst);
            tracing::error!(target: "braid", "wgpu device lost ({reason:?}): {message}");
        });
        // Errors outside any scope (none are expected) are logged, never panicked on.
        device.on_uncaptured_error(Arc::new(|e| tracing::error!(target: "braid", "wgpu error: {e}")));
        let features = Features {
            shader_f16,
            max_workgroups_per_dimension: limits.max_compute_workgroups_per_dimension,
            // Every kernel also binds one uniform buffer, which Metal counts with the storage
            // buffers in one limit of the stage's buffers.
            max_storage_buffers_per_stage: limits
                .max_storage_buffers_per_shader_stage
                .min(limits.max_buffers_and_acceleration_structures_per_shader_stage.saturating_sub(1)),
            max_storage_buffer_binding_size: limits.max_storage_buffer_binding_size.min(limits.max_buffer_size),
            max_workgroup_storage_size: limits.max_compute_workgroup_storage_size,
            max_invocations_per_workgroup: limits
                .max_compute_invocations_per_workgroup
                .min(limits.max_compute_workgroup_size_x),
        };
        let zero = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("braid zero"),
            size: 16,
            usage: wgpu::BufferUsages::UNIFORM,
            // wgpu zero-initialises every buffer.
            mapped_at_creation: false,
        });
        Ok(WgpuContext {
            zero,
            adapter,
            device,
            queue,
            info,
            limits,
            features,
            lost,
            pipelines: kernels::PipelineCache::default(),
            _instance: instance,
        })
    }

    /// One line naming the adapter, its backend and the limits kernels are printed for.
    pub fn describe(&self) -> String {
        let f = &self.features;
        format!(
            "{} ({:?}, {:?}, driver {} {}): {} storage buffers per stage of up to {} MiB, {} workgroups per dimension, \
             {} threads and {} KiB of workgroup memory per workgroup, shader-f16 {}",
            self.info.name,
            self.info.backend,
            self.info.device_type,
            self.info.driver,
            self.info.driver_info,
            f.max_storage_buffers_per_stage,
            f.max_storage_buffer_binding_size >> 20,
            f.max_workgroups_per_dimension,
            f.max_invocations_per_workgroup,
            f.max_workgroup_storage_size >> 10,
            if f.shader_f16 { "yes" } else { "no" }
        )
    }

    /// `Err(Unavailable)` once the device is lost.
    pub fn check_alive(&self) -> Result<(), DeviceError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(DeviceError::Unavailable(format!("the wgpu device {} was lost", self.info.name)));
        }
        Ok(())
    }

    /// Runs `f` inside error scopes for out-of-memory and validation errors: their first error
    /// is returned as `Err` (out of memory as `OutOfMemory` of `requested` bytes, anything
    /// else through `fail`).
    pub fn scoped<T>(
        &self,
        requested: u64,
        fail: impl Fn(String) -> DeviceError,
        f: impl FnOnce() -> T,
    ) -> Result<T, DeviceError> {
        self.check_alive()?;
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let value = f();
        let invalid = block_on(validation.pop())?;
        let out_of_memory = block_on(oom.pop())?;
        if let Some(e) = out_of_memory {
            tracing::debug!(target: "braid", "wgpu out of memory: {e}");
            return Err(DeviceError::OutOfMemory { requested, in_use: 0, reserved: 0 });
        }
        match invalid {
            Some(e) => Err(fail(error_text(&e))),
            None => Ok(value),
        }
    }

    /// Waits for all submitted work (an `Err` if the device is lost or the wait fails).
    pub fn wait(&self) -> Result<(), DeviceError> {
        self.check_alive()?;
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| DeviceError::Kernel(format!("waiting for the wgpu device: {e}")))?;
        self.check_alive()
    }
}

/// A wgpu error with its sources (validation errors keep the useful part in their source).
fn error_text(e: &wgpu::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let line = s.to_string();
        if !text.contains(&line) {
            text = format!("{text}: {line}");
        }
        source = s.source();
    }
    text
}

/// Polls a wgpu future once: native wgpu resolves adapter, device and error-scope futures
/// before returning them, so one poll suffices; anything else is reported, not waited on.
fn block_on<F: std::future::Future>(f: F) -> Result<F::Output, DeviceError> {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => Ok(v),
        std::task::Poll::Pending => Err(DeviceError::Internal("a wgpu future did not resolve at once".into())),
    }
}
