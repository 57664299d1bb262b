//! The per-buffer half of the validator: the happens-before order of a program's steps (vector
//! clocks over lanes), every buffer's accesses, the races between them, and the replay of each
//! buffer's accesses in one valid order. It only reads the [`Program`] it is given.

use super::{Access, Hazard, HazardKind, Lanes, PStep, Pos, Program, StepRef, label};
use hashbrown::HashMap;

/// The happens-before order of a program: vector clocks over lanes, and each step's rank in
/// one valid execution order.
pub(super) struct HappensBefore<'a> {
    lanes: &'a Lanes,
    /// `clock[s][i][l]`: steps of lane `l` that happen-before-or-are step `(s, i)`.
    clock: Vec<Vec<Vec<u32>>>,
    rank: Vec<Vec<usize>>,
}

impl<'a> HappensBefore<'a> {
    pub(super) fn new(p: &Program, lanes: &'a Lanes, order: &[Pos]) -> HappensBefore<'a> {
        let mut clock: Vec<Vec<Vec<u32>>> = p.streams.iter().map(|(_, st)| vec![Vec::new(); st.len()]).collect();
        let mut record_pos: HashMap<u32, Pos> = HashMap::new();
        for (s, (_, steps)) in p.streams.iter().enumerate() {
            for (i, st) in steps.iter().enumerate() {
                if let PStep::Record(e) = st {
                    record_pos.insert(*e, (s, i));
                }
            }
        }
        let mut rank: Vec<Vec<usize>> = p.streams.iter().map(|(_, st)| vec![0; st.len()]).collect();
        for (r, &(s, i)) in order.iter().enumerate() {
            rank[s][i] = r;
            let mut c = match lanes.chain[s][i] {
                Some(j) => clock[s][j].clone(),
                None => vec![0; lanes.count],
            };
            for e in &lanes.events[s][i] {
                let (rs, ri) = record_pos[e];
                for (mine, &theirs) in c.iter_mut().zip(&clock[rs][ri]) {
                    *mine = (*mine).max(theirs);
                }
            }
            c[lanes.lane[s][i]] = lanes.slot[s][i] + 1;
            clock[s][i] = c;
        }
        HappensBefore { lanes, clock, rank }
    }

    /// Whether step `a` happens before step `b`.
    fn before(&self, a: Pos, b: Pos) -> bool {
        a != b && self.clock[b.0][b.1][self.lanes.lane[a.0][a.1]] > self.lanes.slot[a.0][a.1]
    }
}

fn step_ref(p: &Program, (s, i): Pos) -> StepRef {
    StepRef { stream: p.streams[s].0, index: i, label: label(&p.streams[s].1[i]) }
}

/// Every buffer's accesses, and the kernels that hold nodes of another stream.
#[allow(clippy::type_complexity)]
pub(super) fn accesses(p: &Program) -> (HashMap<u32, Vec<(Pos, Access)>>, Vec<Hazard>) {
    let mut hazards = Vec::new();
    let mut accesses: HashMap<u32, Vec<(Pos, Access)>> = HashMap::new();
    for (s, (sid, steps)) in p.streams.iter().enumerate() {
        for (i, st) in steps.iter().enumerate() {
            match st {
                PStep::Kernel { reads, writes, node_streams, .. } => {
                    for &(b, v) in reads {
                        accesses.entry(b).or_default().push(((s, i), Access::Read(v)));
                    }
                    for &(b, v) in writes {
                        accesses.entry(b).or_default().push(((s, i), Access::Write(v)));
                    }
                    if let Some(other) = node_streams.iter().find(|&&ns| ns != *sid) {
                        hazards.push(Hazard {
                            kind: HazardKind::CrossStreamFusion,
                            buffer: None,
                            steps: vec![step_ref(p, (s, i))],
                            message: format!("{} on stream {sid} holds a node of stream {other}", label(st)),
                        });
                    }
                }
                PStep::Alloc(b) => accesses.entry(*b).or_default().push(((s, i), Access::Alloc)),
                PStep::Free { buffer, .. } => accesses.entry(*buffer).or_default().push(((s, i), Access::Free)),
                _ => {}
            }
        }
    }
    (accesses, hazards)
}

/// Pairs of conflicting accesses to buffer `b` (not both reads) that no event orders.
pub(super) fn races(p: &Program, hb: &HappensBefore, b: u32, acc: &[(Pos, Access)]) -> Vec<Hazard> {
    let mut hazards = Vec::new();
    for x in 0..acc.len() {
        for y in x + 1..acc.len() {
            let ((pa, a), (pb, bb)) = (acc[x], acc[y]);
            let conflict = !matches!((a, bb), (Access::Read(_), Access::Read(_)));
            if !conflict || pa == pb || hb.before(pa, pb) || hb.before(pb, pa) {
                continue;
            }
            let kind = match (a, bb) {
                (Access::Free, _) | (_, Access::Free) => HazardKind::UseAfterFree,
                (Access::Write(_), Access::Write(_)) => HazardKind::WriteAfterWrite,
                (Access::Write(_) | Access::Alloc, Access::Read(_)) => HazardKind::ReadAfterWrite,
                _ => HazardKind::WriteAfterRead,
            };
            let (ra, rb) = (step_ref(p, pa), step_ref(p, pb));
            let message = format!("b{b} is used by {ra} and by {rb} with no event ordering them");
            hazards.push(Hazard { kind, buffer: Some(format!("b{b}")), steps: vec![ra, rb], message });
        }
    }
    hazards
}

/// The state of a buffer while its accesses are replayed.
#[derive(Clone, Copy, PartialEq)]
enum BufferState {
    Unallocated,
    Allocated,
    Holds(u64, Pos),
    Freed(Pos),
}

/// Replays the (ordered) accesses to buffer `b` from its state before the flush (`initial`:
/// the value it holds, if any) and returns the first access that finds it in the wrong state.
/// Reads of a step come before its writes (an in-place kernel reads, then overwrites).
pub(super) fn replay(
    p: &Program,
    hb: &HappensBefore,
    b: u32,
    acc: &mut [(Pos, Access)],
    initial: Option<u64>,
) -> Option<Hazard> {
    acc.sort_by_key(|&((s, i), a)| (hb.rank[s][i], !matches!(a, Access::Read(_))));
    let mut state = initial.map_or(BufferState::Unallocated, |v| BufferState::Holds(v, (usize::MAX, 0)));
    let who =
        |pos: Pos| if pos.0 == usize::MAX { "before the flush".to_string() } else { step_ref(p, pos).to_string() };
    // The allocation (or first write) of the buffer: what a too-early access should follow.
    let setup = acc
        .iter()
        .find(|(_, a)| matches!(a, Access::Alloc))
        .or_else(|| acc.iter().find(|(_, a)| matches!(a, Access::Write(_))))
        .map(|&(p, _)| p);
    let mut allocated_at: Option<Pos> = None;
    for &(pos, a) in acc.iter() {
        let problem = match (state, a) {
            (BufferState::Freed(f), _) => {
                Some((HazardKind::UseAfterFree, format!("b{b} was freed by {}", who(f)), Some(f)))
            }
            (BufferState::Unallocated, Access::Alloc)
            | (BufferState::Allocated | BufferState::Holds(..), Access::Write(_)) => None,
            (BufferState::Unallocated, _) => Some((
                HazardKind::ReadAfterWrite,
                format!(
                    "b{b} is not allocated yet{}",
                    setup.filter(|&p| p != pos).map_or(String::new(), |p| format!(" ({} allocates it later)", who(p)))
                ),
                setup.filter(|&p| p != pos),
            )),
            (BufferState::Allocated | BufferState::Holds(..), Access::Alloc) => {
                Some((HazardKind::WriteAfterWrite, format!("b{b} is allocated while it is still live"), allocated_at))
            }
            (BufferState::Allocated, Access::Read(_)) => Some((
                HazardKind::ReadAfterWrite,
                format!("b{b} is read before anything is written to it"),
                allocated_at,
            )),
            (BufferState::Holds(have, w), Access::Read(want)) if have != want => Some((
                HazardKind::WriteAfterRead,
                format!("b{b} should hold n{want} but {} overwrote it with n{have} first (reused too early)", who(w)),
                (w.0 != usize::MAX).then_some(w),
            )),
            _ => None,
        };
        if let Some((kind, why, other)) = problem {
            let mut steps: Vec<StepRef> = other.map(|o| step_ref(p, o)).into_iter().collect();
            steps.push(step_ref(p, pos));
            return Some(Hazard {
                kind,
                buffer: Some(format!("b{b}")),
                message: format!("{}: {why}", step_ref(p, pos)),
                steps,
            });
        }
        state = match a {
            Access::Alloc => {
                allocated_at = Some(pos);
                BufferState::Allocated
            }
            Access::Write(v) => BufferState::Holds(v, pos),
            Access::Read(_) => state,
            Access::Free => BufferState::Freed(pos),
        };
    }
    None
}
