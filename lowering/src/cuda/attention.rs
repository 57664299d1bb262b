//! Fused attention as CUDA C (WORK IN PROGRESS: being written).

use super::{Entry, Param};
use crate::attention::AttentionKernel;

pub(super) fn print_attention(
    _out: &mut String,
    a: &AttentionKernel,
    _name: &str,
    _params: &[Param],
) -> Result<Vec<Entry>, String> {
    Err(format!("attention of {} is not printed for CUDA yet", a.dtype))
}
