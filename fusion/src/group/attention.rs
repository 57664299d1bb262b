//! Attention's parts in one kernel: a part joins an earlier kernel of a sibling part (see
//! [`AttentionPart::runs_with`](braid_graph::AttentionPart::runs_with)) over the very same
//! inputs. It never joins anything else, and nothing joins it.

use super::{Grouper, Kind};
use braid_graph::Op;

impl Grouper<'_> {
    /// An attention kernel that attention node `i` can join: one of the parts it runs
    /// with (see [`AttentionPart::runs_with`](braid_graph::AttentionPart::runs_with)) over the
    /// very same inputs, on the same stream, behind the same waits, with room for its output.
    /// The parts read nothing of each other, so the kernel may run at the first one's place:
    /// however far back it is (a training step records the log-sum-exp in its backward pass,
    /// hundreds of kernels after the output), the sibling reads only what that kernel reads.
    pub(super) fn attention_sibling(&self, i: usize) -> Option<usize> {
        let node = &self.graph.nodes[i];
        let Op::Attention { causal, part } = node.op else { return None };
        (0..self.groups.len()).rev().find(|&g| {
            let grp = &self.groups[g];
            if !matches!(grp.kind, Kind::Attention) {
                return false;
            }
            let first = &self.graph.nodes[grp.nodes[0]];
            let sibling = matches!(first.op, Op::Attention { causal: c, part: p } if c == causal && p.runs_with(part));
            let fresh = grp.nodes.iter().all(|&j| self.graph.nodes[j].op != node.op);
            let buffers = grp.inputs.len() + grp.nodes.len() + 1;
            sibling
                && fresh
                && first.inputs == node.inputs
                && grp.stream == node.stream
                && node.after.iter().all(|a| grp.waits.binary_search(a).is_ok())
                && buffers <= self.options.max_buffers
        })
    }
}
