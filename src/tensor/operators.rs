//! `+ - * /` on tensors (owned or borrowed, in any mix) and with `f64` scalars on either side,
//! unary `-`, and `+= -= *= /=`. Each is a thin call of the named method, so misuse is reported
//! at the operator's line.

use super::Tensor;
use braid_graph::table::BinaryOp;
use std::ops::{Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Sub, SubAssign};

macro_rules! binary_operator {
    ($trait:ident, $method:ident, $op:expr) => {
        impl $trait<&Tensor> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> Tensor {
                self.binary($op, rhs)
            }
        }
        impl $trait<Tensor> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> Tensor {
                self.binary($op, &rhs)
            }
        }
        impl $trait<&Tensor> for Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> Tensor {
                (&self).binary($op, rhs)
            }
        }
        impl $trait<Tensor> for Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> Tensor {
                (&self).binary($op, &rhs)
            }
        }
        impl $trait<f64> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: f64) -> Tensor {
                self.binary_scalar($op, rhs, false)
            }
        }
        impl $trait<f64> for Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: f64) -> Tensor {
                (&self).binary_scalar($op, rhs, false)
            }
        }
        impl $trait<&Tensor> for f64 {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> Tensor {
                rhs.binary_scalar($op, self, true)
            }
        }
        impl $trait<Tensor> for f64 {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> Tensor {
                rhs.binary_scalar($op, self, true)
            }
        }
    };
}

binary_operator!(Add, add, BinaryOp::Add);
binary_operator!(Sub, sub, BinaryOp::Sub);
binary_operator!(Mul, mul, BinaryOp::Mul);
binary_operator!(Div, div, BinaryOp::Div);

impl Neg for &Tensor {
    type Output = Tensor;
    #[track_caller]
    fn neg(self) -> Tensor {
        Tensor::neg(self)
    }
}

impl Neg for Tensor {
    type Output = Tensor;
    #[track_caller]
    fn neg(self) -> Tensor {
        Tensor::neg(&self)
    }
}

macro_rules! assign_operator {
    ($trait:ident, $method:ident, $op:expr) => {
        impl $trait<&Tensor> for Tensor {
            #[track_caller]
            fn $method(&mut self, rhs: &Tensor) {
                self.update_with($op, rhs)
            }
        }
        impl $trait<Tensor> for Tensor {
            #[track_caller]
            fn $method(&mut self, rhs: Tensor) {
                self.update_with($op, &rhs)
            }
        }
        impl $trait<f64> for Tensor {
            #[track_caller]
            fn $method(&mut self, rhs: f64) {
                self.update_with_scalar($op, rhs)
            }
        }
    };
}

assign_operator!(AddAssign, add_assign, BinaryOp::Add);
assign_operator!(SubAssign, sub_assign, BinaryOp::Sub);
assign_operator!(MulAssign, mul_assign, BinaryOp::Mul);
assign_operator!(DivAssign, div_assign, BinaryOp::Div);
