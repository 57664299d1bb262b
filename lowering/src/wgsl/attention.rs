//! Fused attention as WGSL (WORK IN PROGRESS: being written).

use super::Module;
use crate::attention::AttentionKernel;

pub(super) fn print_attention(_m: &mut Module<'_>, a: &AttentionKernel) -> Result<(), String> {
    Err(format!("attention of {} is not printed for WGSL yet", a.dtype))
}
