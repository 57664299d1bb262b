//! The backends devices are made on: a registry of [`Registration`]s by name (the names
//! `BRAID_DEVICE` and [`Device::new`] take), filled with the built-in backends this build has
//! (the CPU, and CUDA and wgpu behind their cargo features) and whatever a program registers
//! with [`register`]. This is the one file outside the backends' own folders that names them:
//! a new backend is its own folders plus a line here (or a `register` call in the program
//! that brings it).
//!
//! ```
//! use braid::prelude::*;
//! use braid::backends::{self, Registration};
//! use std::sync::Arc;
//!
//! // A backend of the program's own (here: the CPU's runtime under another name).
//! let cpu = backends::get("cpu").unwrap();
//! let registered = backends::register(Registration::new("mine", move |n| cpu.open(n)));
//! assert!(registered);
//! let dev = Device::new("mine:1").unwrap();
//! let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev);
//! assert_eq!((x * 2.0).to_vec::<f32>().unwrap(), [2.0, 4.0]);
//! assert!(backends::names().contains(&"mine".to_string()));
//! ```
//!
//! Must never: open a device by itself (only [`Device`]'s constructors do), or replace a
//! registered backend.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::lock;
use braid_devices::{Backend, DeviceError};
use std::sync::{Arc, LazyLock, Mutex};

pub use braid_devices::Registration;

/// The built-in backends, then those the program registered.
static REGISTRY: LazyLock<Mutex<Vec<Registration>>> = LazyLock::new(|| Mutex::new(built_in()));

fn built_in() -> Vec<Registration> {
    vec![braid_devices::cpu::registration(), cuda(), wgpu()]
}

#[cfg(feature = "cuda")]
fn cuda() -> Registration {
    braid_devices::cuda::registration()
}

/// A build without CUDA still knows the name, and says how to get it.
#[cfg(not(feature = "cuda"))]
fn cuda() -> Registration {
    missing("cuda", "CUDA")
}

#[cfg(feature = "wgpu")]
fn wgpu() -> Registration {
    braid_devices::wgpu::registration()
}

#[cfg(not(feature = "wgpu"))]
fn wgpu() -> Registration {
    missing("wgpu", "wgpu")
}

/// A backend this build leaves out: no devices, and opening one says which feature adds it.
#[cfg(any(not(feature = "cuda"), not(feature = "wgpu")))]
fn missing(name: &'static str, what: &'static str) -> Registration {
    Registration::new(name, move |_| {
        Err(DeviceError::Unavailable(format!(
            "this build of braid has no {what} backend (build with the `{name}` feature)"
        )))
    })
    .with_count(|| 0)
}

/// Adds a backend under its name; `false` (and nothing changes) when a backend of that name
/// is registered already, built-in ones included.
pub fn register(backend: Registration) -> bool {
    let mut registry = lock(&REGISTRY);
    if registry.iter().any(|r| r.name() == backend.name()) {
        return false;
    }
    registry.push(backend);
    true
}

/// The backend registered under `name`.
pub fn get(name: &str) -> Option<Registration> {
    lock(&REGISTRY).iter().find(|r| r.name() == name).cloned()
}

/// The names of the registered backends, built-in ones first.
pub fn names() -> Vec<String> {
    lock(&REGISTRY).iter().map(|r| r.name().to_string()).collect()
}

/// A device named as `BRAID_DEVICE` names one: `name` or `name:N`, `name` registered.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct DeviceName {
    pub(crate) backend: String,
    pub(crate) ordinal: Option<usize>,
}

impl DeviceName {
    /// Parses `spec` (surrounding spaces and case ignored); `Err` names what is registered.
    pub(crate) fn parse(spec: &str) -> std::result::Result<DeviceName, String> {
        let v = spec.trim().to_ascii_lowercase();
        let (backend, ordinal) = match v.split_once(':') {
            Some((b, n)) => match n.parse::<usize>() {
                Ok(n) => (b.to_string(), Some(n)),
                Err(_) => return Err(format!("{n:?} after `{b}:` is not a device number")),
            },
            None => (v, None),
        };
        if get(&backend).is_none() {
            let known = names().iter().map(|n| format!("{n}, {n}:N")).collect::<Vec<_>>().join(", ");
            return Err(format!("no backend is registered as {backend:?}; expected one of {known}"));
        }
        Ok(DeviceName { backend, ordinal })
    }

    /// A new device of this name's backend.
    pub(crate) fn open(&self) -> Result<Arc<dyn Backend>> {
        let registration = get(&self.backend).ok_or_else(|| Error::Unavailable(format!("{self} is not registered")))?;
        registration.open(self.ordinal).map_err(|e| match e {
            DeviceError::Unavailable(m) => Error::Unavailable(format!("{self} is unavailable: {m}")),
            other => Error::Device { device: self.to_string(), source: other },
        })
    }
}

impl std::fmt::Display for DeviceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.ordinal {
            Some(n) => write!(f, "{}:{n}", self.backend),
            None => f.write_str(&self.backend),
        }
    }
}

/// Sets up the transport of a new group of `devices`, through their backend: every device
/// must be of one backend (CPU devices meet at the host rendezvous; CUDA devices get NCCL
/// communicators). `Err(Unavailable)` for a mix, or a backend without collectives.
pub(crate) fn connect_group(
    devices: &[Device],
    group: &Arc<braid_devices::collective::RankGroup>,
) -> std::result::Result<(), DeviceError> {
    let backends: Vec<&dyn Backend> = devices.iter().map(|d| d.engine().backend.as_ref()).collect();
    let first = backends[0].as_any().type_id();
    if backends.iter().any(|b| b.as_any().type_id() != first) {
        let names: Vec<String> = devices.iter().map(|d| d.name()).collect();
        return Err(DeviceError::Unavailable(format!(
            "collectives run between devices of one backend, not over {}",
            names.join(", ")
        )));
    }
    backends[0].connect_group(&backends, group)
}
