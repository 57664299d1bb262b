//! How a backend plugs into braid: a [`Registration`] names it (the name `BRAID_DEVICE` and
//! `Device::new("name:N")` use) and says how to open one of its devices and how many the
//! machine has. Each backend makes its own (`cpu::registration`, ...); the engine keeps the
//! list and never names a backend's types.
//!
//! This module only describes backends: it never opens a device by itself.

use crate::DeviceError;
use crate::runtime::Backend;
use std::sync::Arc;

type Open = dyn Fn(Option<usize>) -> Result<Arc<dyn Backend>, DeviceError> + Send + Sync;
type Count = dyn Fn() -> usize + Send + Sync;

/// A backend as the engine's registry knows it.
#[derive(Clone)]
pub struct Registration {
    name: String,
    open: Arc<Open>,
    count: Arc<Count>,
}

impl Registration {
    /// A backend called `name` (lowercase letters, digits and `_`, starting with a letter)
    /// whose devices `open` makes: `open(Some(n))` for `name:n`, `open(None)` for a bare
    /// `name`. Each call makes a new, independent device. The machine has one device of it
    /// unless [`Registration::with_count`] says otherwise.
    ///
    /// # Panics
    /// When `name` is not such a name (misuse, reported at the caller's line).
    #[track_caller]
    pub fn new(
        name: &str,
        open: impl Fn(Option<usize>) -> Result<Arc<dyn Backend>, DeviceError> + Send + Sync + 'static,
    ) -> Registration {
        let valid = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
            && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        assert!(valid, "a backend's name is lowercase letters, digits and `_`, starting with a letter; not {name:?}");
        Registration { name: name.to_string(), open: Arc::new(open), count: Arc::new(|| 1) }
    }

    /// How many devices of this backend the machine has (`count` is asked each time; it
    /// never fails: 0 when the library or the hardware is missing).
    pub fn with_count(mut self, count: impl Fn() -> usize + Send + Sync + 'static) -> Registration {
        self.count = Arc::new(count);
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// A new device of this backend (`ordinal`: the `N` of `name:N`).
    pub fn open(&self, ordinal: Option<usize>) -> Result<Arc<dyn Backend>, DeviceError> {
        (self.open)(ordinal)
    }

    /// How many devices of this backend the machine has.
    pub fn count(&self) -> usize {
        (self.count)()
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Registration({})", self.name)
    }
}
