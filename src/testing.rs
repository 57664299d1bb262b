//! Test-only hooks (hidden from the docs): they let tests corrupt what the planner produced and
//! watch the engine refuse to run it. Never used by the engine itself.

use crate::device::{Device, lock};
use braid_scheduler::Schedule;
use std::sync::Arc;

/// A function applied to every schedule planned for a device, before validation.
pub type ScheduleHook = Arc<dyn Fn(&mut Schedule) + Send + Sync>;

/// Installs (or with `None` removes) a hook that rewrites every schedule planned for `device`.
pub fn set_schedule_hook(device: &Device, hook: Option<ScheduleHook>) {
    *lock(&device.0.schedule_hook) = hook;
}
