// Comparing a tuning candidate's outputs with the default's on the GPU (devices/src/cuda/tune.rs):
// r[0] counts the elements that must match exactly and do not (every byte, for a bitwise
// candidate; the NaN and infinity positions of a float one), r[1] and r[2] are the largest |a|
// over the default's finite elements and the largest |a - b| over elements finite in both, as
// the bits of non-negative doubles (whose order as integers is their order as numbers). Each
// thread folds its elements, each warp combines its threads, and one lane a warp adds to r.

__device__ double braid_f16(unsigned short h) {
  unsigned int sign = (h >> 15) & 1u, exp = (h >> 10) & 31u, man = h & 1023u;
  double v;
  if (exp == 0u) v = ldexp((double)man, -24);
  else if (exp == 31u) v = man ? __longlong_as_double(0x7ff8000000000000LL) : __longlong_as_double(0x7ff0000000000000LL);
  else v = ldexp((double)(man | 1024u), (int)exp - 25);
  return sign ? -v : v;
}

__device__ double braid_bf16(unsigned short h) { return (double)__uint_as_float(((unsigned int)h) << 16); }

struct BraidFold {
  unsigned long long count, scale, diff;
  __device__ BraidFold() : count(0ull), scale(0ull), diff(0ull) {}
  __device__ void add(double a, double b) {
    bool fa = isfinite(a), fb = isfinite(b);
    if (fa) {
      unsigned long long s = (unsigned long long)__double_as_longlong(fabs(a));
      scale = s > scale ? s : scale;
    }
    if (fa && fb) {
      unsigned long long d = (unsigned long long)__double_as_longlong(fabs(a - b));
      diff = d > diff ? d : diff;
    } else if (!((isnan(a) && isnan(b)) || a == b)) {
      count += 1ull;
    }
  }
  __device__ void flush(unsigned long long* r) {
    for (int o = 16; o > 0; o >>= 1) {
      count += __shfl_down_sync(0xffffffffu, count, o);
      unsigned long long s = __shfl_down_sync(0xffffffffu, scale, o);
      unsigned long long d = __shfl_down_sync(0xffffffffu, diff, o);
      scale = s > scale ? s : scale;
      diff = d > diff ? d : diff;
    }
    if ((threadIdx.x & 31u) == 0u) {
      if (count) atomicAdd(&r[0], count);
      atomicMax(&r[1], scale);
      atomicMax(&r[2], diff);
    }
  }
};

// Every thread of a block reaches `flush` (blocks are whole warps), so the shuffles are full.
#define BRAID_LOOP for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x)

extern "C" __global__ void braid_compare_bytes(const unsigned char* a, const unsigned char* b, unsigned long long n, unsigned long long* r) {
  BraidFold f;
  BRAID_LOOP { if (a[i] != b[i]) f.count += 1ull; }
  f.flush(r);
}
extern "C" __global__ void braid_compare_f64(const double* a, const double* b, unsigned long long n, unsigned long long* r) {
  BraidFold f;
  BRAID_LOOP { f.add(a[i], b[i]); }
  f.flush(r);
}
extern "C" __global__ void braid_compare_f32(const float* a, const float* b, unsigned long long n, unsigned long long* r) {
  BraidFold f;
  BRAID_LOOP { f.add((double)a[i], (double)b[i]); }
  f.flush(r);
}
extern "C" __global__ void braid_compare_f16(const unsigned short* a, const unsigned short* b, unsigned long long n, unsigned long long* r) {
  BraidFold f;
  BRAID_LOOP { f.add(braid_f16(a[i]), braid_f16(b[i])); }
  f.flush(r);
}
extern "C" __global__ void braid_compare_bf16(const unsigned short* a, const unsigned short* b, unsigned long long n, unsigned long long* r) {
  BraidFold f;
  BRAID_LOOP { f.add(braid_bf16(a[i]), braid_bf16(b[i])); }
  f.flush(r);
}
