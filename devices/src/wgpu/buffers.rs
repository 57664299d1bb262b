//! Buffers on wgpu: storage buffers for kernel arguments (sizes rounded up to whole 4-byte
//! words, which storage bindings need), uploads through the queue, and readback through a
//! mapped staging buffer. Creating a buffer beyond the adapter's limit, or without memory, is
//! an `Err`. Also [`run_kernel_on_wgpu`], which runs one kernel over host data (for tests).

use super::WgpuContext;
use crate::DeviceError;
use braid_lowering::Kernel;
use braid_lowering::wgsl::Binding;
use std::sync::{Arc, Mutex};

/// Usages of every storage buffer: bound by kernels, copied to and from.
const STORAGE: wgpu::BufferUsages =
    wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC).union(wgpu::BufferUsages::COPY_DST);

impl WgpuContext {
    /// A storage buffer of at least `bytes` bytes (whole words, at least one), contents
    /// unspecified. `Err(OutOfMemory)` without memory; `Err(Kernel)` past the adapter's
    /// `max_buffer_size`.
    pub fn create_buffer(&self, bytes: u64) -> Result<wgpu::Buffer, DeviceError> {
        self.create(bytes, STORAGE, "braid buffer")
    }

    fn create(&self, bytes: u64, usage: wgpu::BufferUsages, label: &str) -> Result<wgpu::Buffer, DeviceError> {
        let size = bytes.div_ceil(4).max(1) * 4;
        if size > self.limits.max_buffer_size {
            return Err(DeviceError::Kernel(format!(
                "a buffer of {size} bytes exceeds the adapter's max_buffer_size ({})",
                self.limits.max_buffer_size
            )));
        }
        let fail = |e: String| DeviceError::Kernel(format!("creating a buffer of {size} bytes: {e}"));
        self.scoped(size, fail, || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage,
                mapped_at_creation: false,
            })
        })
    }

    /// A storage buffer holding `bytes` (zero-padded to whole words).
    pub fn upload(&self, bytes: &[u8]) -> Result<wgpu::Buffer, DeviceError> {
        let buffer = self.create_buffer(bytes.len() as u64)?;
        self.write(&buffer, bytes)?;
        Ok(buffer)
    }

    /// Writes `bytes` at the start of `buffer` (zero-padded to whole words), ordered before
    /// later submissions.
    pub fn write(&self, buffer: &wgpu::Buffer, bytes: &[u8]) -> Result<(), DeviceError> {
        let padded = bytes.len().div_ceil(4) * 4;
        if padded as u64 > buffer.size() {
            return Err(DeviceError::Kernel(format!("writing {} bytes to a buffer of {}", bytes.len(), buffer.size())));
        }
        let fail = |e: String| DeviceError::Kernel(format!("writing {} bytes: {e}", bytes.len()));
        self.scoped(padded as u64, fail, || {
            if padded == bytes.len() {
                self.queue.write_buffer(buffer, 0, bytes);
            } else {
                let mut data = bytes.to_vec();
                data.resize(padded, 0);
                self.queue.write_buffer(buffer, 0, &data);
            }
        })
    }

    /// Submits `encoder`'s commands (an `Err` on a validation error or out of memory).
    pub fn submit(&self, encoder: wgpu::CommandEncoder) -> Result<(), DeviceError> {
        let fail = |e: String| DeviceError::Kernel(format!("submitting wgpu commands: {e}"));
        self.scoped(0, fail, || {
            self.queue.submit([encoder.finish()]);
        })
    }

    /// A new command encoder.
    pub fn encoder(&self) -> wgpu::CommandEncoder {
        self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("braid") })
    }

    /// The first `bytes` bytes of `buffer`, after all work submitted so far: copied into a
    /// mapped staging buffer, waited for, and read.
    pub fn read(&self, buffer: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>, DeviceError> {
        self.read_at(buffer, 0, bytes)
    }

    /// [`WgpuContext::read`] of `bytes` bytes from byte `offset` (a multiple of 4).
    pub fn read_at(&self, buffer: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>, DeviceError> {
        let size = bytes.div_ceil(4) * 4;
        if !offset.is_multiple_of(4) || offset + size > buffer.size() {
            return Err(DeviceError::Kernel(format!(
                "reading {bytes} bytes at {offset} of a buffer of {}",
                buffer.size()
            )));
        }
        if bytes == 0 {
            return Ok(vec![]);
        }
        let usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
        let staging = self.create(size, usage, "braid readback")?;
        let mut encoder = self.encoder();
        encoder.copy_buffer_to_buffer(buffer, offset, &staging, 0, size);
        self.submit(encoder)?;
        let mapped: Arc<Mutex<Option<Result<(), wgpu::BufferAsyncError>>>> = Arc::default();
        let done = mapped.clone();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            if let Ok(mut slot) = done.lock() {
                *slot = Some(r);
            }
        });
        self.wait()?;
        // Another thread polling the same device may have collected this callback and not
        // run it yet when our wait returns: poll until it has run (it must, soon).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let outcome = loop {
            let slot = mapped.lock().map_err(|_| DeviceError::Internal("readback lock poisoned".into()))?.take();
            if slot.is_some() || std::time::Instant::now() > deadline {
                break slot;
            }
            std::thread::yield_now();
            self.device
                .poll(wgpu::PollType::Poll)
                .map_err(|e| DeviceError::Kernel(format!("polling the wgpu device: {e}")))?;
        };
        match outcome {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(DeviceError::Kernel(format!("mapping a readback buffer: {e}"))),
            None => return Err(DeviceError::Internal("a readback buffer was not mapped after the wait".into())),
        }
        let data = {
            let view = staging
                .get_mapped_range(..)
                .map_err(|e| DeviceError::Kernel(format!("reading a mapped buffer: {e}")))?;
            view[..bytes as usize].to_vec()
        };
        staging.unmap();
        Ok(data)
    }
}

/// Runs `kernel` on the wgpu device over host data (for tests): uploads every argument
/// (`args[i]` holds argument `i`'s bytes), provides scratch buffers, encodes and submits the
/// kernel, waits, and reads the outputs back into `args[kernel.inputs..]`.
pub fn run_kernel_on_wgpu(ctx: &WgpuContext, kernel: &Kernel, args: &mut [Vec<u8>]) -> Result<(), DeviceError> {
    if args.len() != kernel.args.len() {
        return Err(DeviceError::Kernel(format!("{} arguments for a kernel of {}", args.len(), kernel.args.len())));
    }
    for (i, (a, bytes)) in kernel.args.iter().zip(args.iter()).enumerate() {
        if bytes.len() != a.len * a.dtype.size() {
            return Err(DeviceError::Kernel(format!("argument {i}: {} bytes for {} {}", bytes.len(), a.len, a.dtype)));
        }
    }
    let printed = braid_lowering::wgsl::print(kernel, &ctx.features).map_err(DeviceError::Kernel)?;
    run_printed_on_wgpu(ctx, kernel, printed, args)
}

/// [`run_kernel_on_wgpu`] with `printed`, the kernel as printed (for tests that print with
/// other [`Features`](braid_lowering::wgsl::Features) than the device's, such as fewer
/// workgroups per dimension).
pub fn run_printed_on_wgpu(
    ctx: &WgpuContext,
    kernel: &Kernel,
    printed: braid_lowering::wgsl::WgslSource,
    args: &mut [Vec<u8>],
) -> Result<(), DeviceError> {
    if args.len() != kernel.args.len() {
        return Err(DeviceError::Kernel(format!("{} arguments for a kernel of {}", args.len(), kernel.args.len())));
    }
    let compiled = ctx.compile(printed)?;
    let mut buffers = Vec::with_capacity(compiled.source.bindings.len());
    for bytes in args.iter() {
        buffers.push(ctx.upload(bytes)?);
    }
    for b in compiled.source.bindings[args.len()..].iter().filter(|b| !matches!(b, Binding::Zero)) {
        buffers.push(ctx.create_buffer(b.bytes())?);
    }
    let mut encoder = ctx.encoder();
    let refs: Vec<&wgpu::Buffer> = buffers.iter().collect();
    ctx.encode(&mut encoder, &compiled, &refs)?;
    ctx.submit(encoder)?;
    for i in kernel.inputs..args.len() {
        args[i] = ctx.read(&buffers[i], args[i].len() as u64)?;
    }
    // The last read waited for everything; a kernel without outputs is waited for here.
    ctx.wait()
}
