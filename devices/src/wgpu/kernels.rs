//! Kernels on wgpu: printing to WGSL, compiling each entry point into a compute pipeline
//! (cached by printed source), and encoding a kernel's dispatches over given buffers into a
//! command encoder. Encoding records work; submitting and waiting are the caller's.

use super::WgpuContext;
use crate::DeviceError;
use braid_lowering::Kernel;
use braid_lowering::wgsl::{self, Binding, WgslSource};
use std::sync::{Arc, Mutex};

/// A printed kernel with its pipelines, one per entry point, sharing one bind group layout
/// (every binding read-write storage).
pub struct WgslKernel {
    pub source: WgslSource,
    layout: wgpu::BindGroupLayout,
    pipelines: Vec<wgpu::ComputePipeline>,
}

/// Compiled kernels by printed source. Kernels are few and small, so it only stops growing
/// past [`MAX_PIPELINES`] (it then starts over).
#[derive(Default)]
pub(super) struct PipelineCache {
    by_source: Mutex<hashbrown::HashMap<String, Arc<WgslKernel>>>,
}

const MAX_PIPELINES: usize = 4096;

impl WgpuContext {
    /// Prints `kernel` for this device and compiles it, or takes its pipelines from the cache.
    pub fn kernel(&self, kernel: &Kernel) -> Result<Arc<WgslKernel>, DeviceError> {
        let source = wgsl::print(kernel, &self.features).map_err(DeviceError::Kernel)?;
        self.compile(source)
    }

    /// Compiles printed WGSL, or takes its pipelines from the cache.
    pub fn compile(&self, source: WgslSource) -> Result<Arc<WgslKernel>, DeviceError> {
        if let Some(k) = self.pipelines.by_source.lock().map_err(poisoned)?.get(&source.source) {
            // Two kernels can print the same text yet bind different buffers (an argument or
            // scratch) and dispatch different shapes: only the compiled pipelines are shared,
            // the bindings and launch shapes stay the caller's.
            if k.source == source {
                return Ok(k.clone());
            }
            return Ok(Arc::new(WgslKernel { source, layout: k.layout.clone(), pipelines: k.pipelines.clone() }));
        }
        let fail = |e: String| DeviceError::Kernel(format!("WGSL kernel rejected: {e}"));
        let entries: Vec<wgpu::BindGroupLayoutEntry> = (source.bindings.iter().enumerate())
            .map(|(binding, b)| wgpu::BindGroupLayoutEntry {
                binding: binding as u32,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: match b {
                        Binding::Zero => wgpu::BufferBindingType::Uniform,
                        _ => wgpu::BufferBindingType::Storage { read_only: false },
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let compiled = self.scoped(0, fail, || {
            let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some("braid kernel"),
                source: wgpu::ShaderSource::Wgsl(source.source.as_str().into()),
            });
            let layout = self.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some("braid kernel bindings"),
                entries: &entries,
            });
            let pipeline_layout = self.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some("braid kernel layout"),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
            let pipelines = (source.entries.iter())
                .map(|e| {
                    self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                        label: Some(&e.name),
                        layout: Some(&pipeline_layout),
                        module: &module,
                        entry_point: Some(&e.name),
                        compilation_options: Default::default(),
                        cache: None,
                    })
                })
                .collect();
            (layout, pipelines)
        });
        let (layout, pipelines) = compiled.map_err(|e| match e {
            DeviceError::Kernel(m) => DeviceError::Kernel(format!("{m}\n--- source:\n{}", source.source)),
            e => e,
        })?;
        let kernel = Arc::new(WgslKernel { source, layout, pipelines });
        let mut cache = self.pipelines.by_source.lock().map_err(poisoned)?;
        if cache.len() >= MAX_PIPELINES {
            cache.clear();
        }
        cache.insert(kernel.source.source.clone(), kernel.clone());
        Ok(kernel)
    }

    /// Pipelines compiled so far (for tests of the cache).
    pub fn cached_kernels(&self) -> usize {
        self.pipelines.by_source.lock().map_or(0, |c| c.len())
    }

    /// Encodes `kernel`'s dispatches, in order, into `encoder`: `buffers[b]` is bound at
    /// binding `b` (the kernel's arguments, then its scratch buffers, as
    /// [`WgslSource::bindings`] lists them), each from byte 0 over the binding's size, which the
    /// buffer must cover; the context binds its own zero buffer to [`Binding::Zero`]. Nothing
    /// runs until the caller submits the encoder.
    pub fn encode(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        kernel: &WgslKernel,
        buffers: &[&wgpu::Buffer],
    ) -> Result<(), DeviceError> {
        let at: Vec<(&wgpu::Buffer, u64)> = buffers.iter().map(|b| (*b, 0)).collect();
        self.encode_at(encoder, kernel, &at)
    }

    /// [`WgpuContext::encode`] with each binding at an offset into its buffer (a multiple of
    /// the adapter's `min_storage_buffer_offset_alignment`): `(buffer, offset)` per binding.
    pub fn encode_at(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        kernel: &WgslKernel,
        buffers: &[(&wgpu::Buffer, u64)],
    ) -> Result<(), DeviceError> {
        let bindings: Vec<Binding> = kernel.source.bindings.iter().copied().filter(|b| *b != Binding::Zero).collect();
        if buffers.len() != bindings.len() {
            return Err(DeviceError::Kernel(format!(
                "{} buffers for a kernel of {} bindings",
                buffers.len(),
                bindings.len()
            )));
        }
        let mut entries = Vec::with_capacity(bindings.len());
        for (b, (&(buffer, offset), binding)) in buffers.iter().zip(&bindings).enumerate() {
            let bytes = binding.bytes();
            if buffer.size() < offset + bytes {
                return Err(DeviceError::Kernel(format!(
                    "binding {b} needs {bytes} bytes at {offset}, its buffer has {}",
                    buffer.size()
                )));
            }
            entries.push(wgpu::BindGroupEntry {
                binding: b as u32,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer,
                    offset,
                    size: wgpu::BufferSize::new(bytes),
                }),
            });
        }
        entries.push(wgpu::BindGroupEntry { binding: bindings.len() as u32, resource: self.zero.as_entire_binding() });
        let fail = |e: String| DeviceError::Kernel(format!("encoding a WGSL kernel: {e}"));
        let bind_group = self.scoped(0, fail, || {
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("braid kernel arguments"),
                layout: &kernel.layout,
                entries: &entries,
            })
        })?;
        // The buffer and offset bound to argument `arg`.
        let bound = |arg: u16| {
            let b = bindings.iter().position(|b| matches!(b, Binding::Arg { arg: a, .. } if *a == arg))?;
            buffers.get(b).map(|&(buffer, offset)| (buffer, offset))
        };
        // One pass per entry: each entry reads what the previous one wrote.
        for (entry, pipeline) in kernel.source.entries.iter().zip(&kernel.pipelines) {
            if let Some((from, to)) = entry.copy
                && let (Some((a, x)), Some((b, y))) = (bound(from), bound(to))
                && a == b
                && x == y
            {
                continue; // a copy onto itself: the scatter was written over its base
            }
            let mut pass = encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(&entry.name), timestamp_writes: None });
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            let [x, y, z] = entry.workgroups;
            pass.dispatch_workgroups(x, y, z);
        }
        Ok(())
    }
}

fn poisoned<T>(_: T) -> DeviceError {
    DeviceError::Internal("the wgpu pipeline cache's lock was poisoned".into())
}
