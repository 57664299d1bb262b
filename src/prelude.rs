//! `use braid::prelude::*;` brings the types every program needs (and no operator traits, so
//! `t.neg()` is always the tensor method).

pub use crate::autograd::Grads;
pub use crate::device::{CompileMode, Device, MemoryStats};
pub use crate::error::{Error, Result};
pub use crate::stream::{Event, Stream};
pub use crate::tensor::Tensor;
pub use braid_graph::{DType, Element, Shape};
