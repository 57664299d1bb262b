//! Concatenation (`Op::Cat`) as map loops: every input fills its region of the output, a value
//! by a copy loop, a folded constant (a padded product's zeros) by a fill loop, and a value
//! computed by the same map kernel by a second store of that loop (fusion lets a concatenation
//! join the map kernel of its inputs when nothing else reads them, see `braid_fusion`): the
//! gradient of a narrow is then written into its padded place, never written and copied.
//!
//! A reshape that is no view of its input (heads merged back into rows after a permute: the
//! gradients of attention's q, k and v concatenated into the gradient of one product) folds
//! into the concatenation too (`braid_fusion`'s `fold.rs`): its copy loop walks the input's
//! shape and stores through the region split the same way, one copy instead of two.
//!
//! Must never: read a value the kernel computes through a copy loop (it is not in memory).

use super::{Lowering, Source};
use crate::kernel::{Load, MapLoop, Store};
use braid_fusion::Segment;
use braid_graph::expr::ExprBuilder;
use braid_graph::{Op, ValueRef, View};

impl Lowering<'_> {
    /// When `v` is a folded reshape that is no view of what it reads (`fold.rs` folds those
    /// into concatenations only): the value underneath and the view it is read through, over
    /// the reshape's input shape.
    fn merged_rows(&self, v: ValueRef) -> Option<(ValueRef, View)> {
        let ValueRef::Node(j) = v else { return None };
        let node = &self.graph.nodes[j];
        if !self.folded[j] || !matches!(node.op, Op::Reshape | Op::Contiguous) {
            return None;
        }
        match self.source(node.inputs[0]) {
            Source::Value(u, view) if view.reshape(&node.shape).is_none() => Some((u, view)),
            _ => None,
        }
    }

    /// The loops that fill concatenation `c`'s regions from the inputs `computed` does not
    /// claim (the values a fused map loop stores there itself): a copy loop per value, a fill
    /// loop per constant.
    pub(super) fn cat_loops(&self, seg: &Segment, c: usize, computed: &dyn Fn(ValueRef) -> bool) -> Vec<MapLoop> {
        let node = &self.graph.nodes[c];
        let out = Self::out_arg(seg, c);
        let mut loops = Vec::new();
        for (k, &v) in node.inputs.iter().enumerate() {
            if computed(v) {
                continue;
            }
            let mut region = braid_fusion::cat_region(self.graph, c, k);
            let read = match self.merged_rows(v) {
                // A reshape that is no view of what it reads, folded into the concatenation:
                // copied in its input's order into the region split the same way.
                Some((u, view)) => {
                    region = region.reshape(&view.shape()).expect("fusion folds such a reshape only where it splits");
                    Source::Value(u, view)
                }
                None => self.source(v),
            };
            let mut b = ExprBuilder::new();
            let (value, loads) = match read {
                Source::Const(x, dtype) => (b.constant(x, dtype), vec![]),
                Source::Value(u, view) => {
                    let dtype = self.graph.meta(u).0;
                    (b.load(0, dtype), vec![Load { arg: Self::arg_of(seg, u), dtype, view }])
                }
            };
            let mut l = MapLoop {
                dims: region.dims.clone(),
                loads,
                expr: b.finish(),
                stores: vec![Store { arg: out, dtype: node.dtype, view: region, value }],
            };
            l.simplify();
            loops.push(l);
        }
        loops
    }
}
