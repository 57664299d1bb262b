//! `+ - * /` on tensors (owned or borrowed, in any mix) and with scalars: on the right any
//! [`Scalar`] (`&x * 2`, `&x * 0.5f32`, `&x * 2.0`), on the left an `f64` or an `i32` (`1.0 - &x`,
//! `2 * &x`; one float and one integer type there, so literals never need annotations),
//! unary `-`, and `+= -= *= /=`. Each is a thin call of the named method, so misuse is reported
//! at the operator's line. A scalar converts to the tensor's dtype as `binary_scalar` says.

use super::Tensor;
use braid_graph::table::BinaryOp;
use std::ops::{Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Sub, SubAssign};

/// A number usable as a scalar operand: `f64`, `f32`, `i32`, `i64`, `u8`. One generic
/// operator impl per operator (not one per type), so an unannotated float literal stays an `f64`
/// and an integer literal an `i32`.
pub trait Scalar: Copy {
    fn to_f64(self) -> f64;
}

macro_rules! scalar_types {
    ($($t:ty),*) => {$(
        impl Scalar for $t {
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    )*};
}
scalar_types!(f64, f32, i32, i64, u8);

macro_rules! scalar_operator {
    ($trait:ident, $method:ident, $op:expr, $($t:ty),*) => {
        impl<S: Scalar> $trait<S> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: S) -> Tensor {
                self.binary_scalar($op, rhs.to_f64(), false)
            }
        }
        impl<S: Scalar> $trait<S> for Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: S) -> Tensor {
                (&self).binary_scalar($op, rhs.to_f64(), false)
            }
        }
        $(
            impl $trait<&Tensor> for $t {
                type Output = Tensor;
                #[track_caller]
                fn $method(self, rhs: &Tensor) -> Tensor {
                    rhs.binary_scalar($op, self as f64, true)
                }
            }
            impl $trait<Tensor> for $t {
                type Output = Tensor;
                #[track_caller]
                fn $method(self, rhs: Tensor) -> Tensor {
                    rhs.binary_scalar($op, self as f64, true)
                }
            }
        )*
    };
}

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
        scalar_operator!($trait, $method, $op, f64, i32);
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
        impl<S: Scalar> $trait<S> for Tensor {
            #[track_caller]
            fn $method(&mut self, rhs: S) {
                self.update_with_scalar($op, rhs.to_f64())
            }
        }
    };
}

assign_operator!(AddAssign, add_assign, BinaryOp::Add);
assign_operator!(SubAssign, sub_assign, BinaryOp::Sub);
assign_operator!(MulAssign, mul_assign, BinaryOp::Mul);
assign_operator!(DivAssign, div_assign, BinaryOp::Div);

#[cfg(test)]
mod tests {
    use crate::prelude::*;

    #[test]
    fn scalars_of_any_numeric_type() {
        let dev = Device::new_cpu();
        let x = Tensor::from_vec(vec![1.0f32, 2.0], [2], &dev);
        assert_eq!((&x * 2).to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
        assert_eq!((&x * 2.0).to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
        assert_eq!((&x * 0.5f32).to_vec::<f32>().unwrap(), vec![0.5, 1.0]);
        assert_eq!((1.5 + &x).to_vec::<f32>().unwrap(), vec![2.5, 3.5]);
        assert_eq!((3 - &x).to_vec::<f32>().unwrap(), vec![2.0, 1.0]);
        assert_eq!((&x - 3i64).to_vec::<f32>().unwrap(), vec![-2.0, -1.0]);
        let mut y = Tensor::from_vec(vec![4i32, 6], [2], &dev);
        y /= 2;
        assert_eq!(y.to_vec::<i32>().unwrap(), vec![2, 3]);
    }
}
