//! # braid-graph: the IR
//!
//! What a recorded computation *is*: element types ([`DType`], [`Element`]), shapes with NumPy
//! broadcasting ([`Shape`]), operations ([`Op`]) and the op table they come from
//! ([`table`]), the scalar expression language kernels are written in ([`expr`]), shape and
//! dtype inference ([`infer`]), the recorded graph ([`Graph`]) and the extracted
//! subgraph of one flush ([`FlushGraph`]), and what a backend is like ([`Target`]).
//!
//! This crate never executes anything and never decides what runs where; fusion, scheduling,
//! lowering and devices build on it. With the `reference` feature it also holds the f64
//! reference interpreter that tests compare every device against.

pub mod diff;
pub mod dtype;
pub mod expr;
pub mod flush;
pub mod infer;
pub mod ir;
pub mod op;
pub mod quant;
#[cfg(feature = "reference")]
pub mod reference;
pub mod rng;
pub mod shape;
pub mod table;
pub mod target;
pub mod view;

pub use dtype::{DType, DTypeClass, Element};
pub use flush::{External, FlushGraph, FlushNode, ValueRef};
pub use ir::{DeviceId, Edge, Graph, Node, NodeId, StreamId};
pub use op::{AttentionPart, Collective, CollectiveKind, Op, ReduceOp, Scalar};
pub use quant::{QuantLayout, Scheme};
pub use shape::Shape;
pub use table::{BinaryOp, CompareOp, DTypeRule, Sensitivity, UnaryOp};
pub use target::{CostModel, DTypes, MemoryKind, PlatformMath, ProductPadding, Target};
pub use view::View;
