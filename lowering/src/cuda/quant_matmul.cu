// Products with quantized weights (braid_graph::quant's layout): included by a kernel that has
// one (lowering/src/cuda/quant.rs prints the entry that calls qm_gemv or qm_tiled).
//
// The weight is one byte buffer: channel j's values at j * ROW_BYTES (16-byte aligned rows,
// int8: one signed byte a value; int4: two signed nibbles a byte, the lower first), then the
// scales at SCALES (f32 or f16, n x groups). Every weight element is value * scale in f32, and
// products accumulate in f32: qm_gemv applies a scale to a sum of value x input terms of its
// group (the reference allows half an f32 ulp a weight for that), qm_tiled to each value.
//
// Kinds: XK (the input's and the product's dtype) 0 f32, 1 f16, 2 bf16; SK (scales) 0 f32,
// 1 f16. Halves are converted by their bits, in plain C (no fp16 header, no PTX: the printer
// tests run this code on the host), the product rounded to nearest even once, as the CPU does.
// Vector loads are taken only where the address is aligned for them (checked at run time).

__device__ __forceinline__ float qm_f16(unsigned short h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  // (The printer tests run this code on the host: the same conversion, by its bits.)
  const unsigned s = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
  if (e == 0) return __uint_as_float(__float_as_uint((float)m * 5.9604644775390625e-8f) | s);
  if (e == 31) return __uint_as_float(s | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
  return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
#endif
}
__device__ __forceinline__ float qm_bf16(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ __forceinline__ unsigned short qm_to_bf16(float f) {
  const unsigned x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
  return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ unsigned short qm_to_f16(float f) {
  const unsigned x = __float_as_uint(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // 65520 and up: infinity
  if (a >= 0x38800000u) return (unsigned short)(sign | ((a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u)) >> 13));
  // Subnormal (or zero): m * 2^-24, m rounded to nearest even (exact scaling, one rounding).
  return (unsigned short)(sign | (unsigned)rintf(__uint_as_float(a) * 16777216.0f));
}

template <int XK> __device__ __forceinline__ float qm_x(const void* x, long long i) {
  if (XK == 0) return __ldg((const float*)x + i);
  const unsigned short b = __ldg((const unsigned short*)x + i);
  return XK == 1 ? qm_f16(b) : qm_bf16(b);
}

// Eight consecutive inputs from element i (16-byte aligned: the caller checks).
template <int XK> __device__ __forceinline__ void qm_x8(const void* x, long long i, float* v) {
  if (XK == 0) {
    const float4 a = __ldg((const float4*)((const float*)x + i));
    const float4 b = __ldg((const float4*)((const float*)x + i + 4));
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
    const uint4 u = __ldg((const uint4*)((const unsigned short*)x + i));
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const unsigned short lo = (unsigned short)(w[t] & 0xffffu), hi = (unsigned short)(w[t] >> 16);
      v[2 * t] = XK == 1 ? qm_f16(lo) : qm_bf16(lo);
      v[2 * t + 1] = XK == 1 ? qm_f16(hi) : qm_bf16(hi);
    }
  }
}

// `words` little-endian 32-bit words from p: one vector load when p is aligned for it.
template <int WORDS> __device__ __forceinline__ uint4 qm_bytes(const unsigned char* p, bool stream) {
  uint4 q = make_uint4(0, 0, 0, 0);
  const unsigned long long at = (unsigned long long)p;
  if (WORDS == 4 && at % 16 == 0) return stream ? __ldcs((const uint4*)p) : __ldg((const uint4*)p);
  if (WORDS == 2 && at % 8 == 0) {
    const uint2 b = __ldg((const uint2*)p);
    q.x = b.x;
    q.y = b.y;
    return q;
  }
  if (WORDS == 1 && at % 4 == 0) {
    q.x = __ldg((const unsigned*)p);
    return q;
  }
  unsigned w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int b = 0; b < 4 * WORDS; ++b) w[b / 4] |= (unsigned)__ldg(p + b) << (8 * (b % 4));
  q.x = w[0]; q.y = w[1]; q.z = w[2]; q.w = w[3];
  return q;
}

// The bits of scale `at` (an index into the scales): one load when the buffer is aligned
// (then so is every scale: they start at a multiple of 16), else byte by byte. Kept as bits
// until used, so that a load issued ahead is not waited for by a conversion.
template <int SK> __device__ __forceinline__ unsigned qm_scale_bits(const unsigned char* w, long long scales,
                                                                   long long at, bool aligned) {
  const unsigned char* p = w + scales + (SK == 0 ? 4 : 2) * at;
  if (SK == 0) return aligned ? __ldg((const unsigned*)p) : qm_bytes<1>(p, false).x;
  return aligned ? __ldg((const unsigned short*)p) : (unsigned)__ldg(p) | (unsigned)__ldg(p + 1) << 8;
}
template <int SK> __device__ __forceinline__ float qm_scale_of(unsigned bits) {
  return SK == 0 ? __uint_as_float(bits) : qm_f16((unsigned short)bits);
}
template <int SK> __device__ __forceinline__ float qm_scale(const unsigned char* w, long long scales, long long at,
                                                           bool aligned) {
  return qm_scale_of<SK>(qm_scale_bits<SK>(w, scales, at, aligned));
}

template <int XK> __device__ __forceinline__ void qm_store(void* out, long long i, float v) {
  if (XK == 0) ((float*)out)[i] = v;
  else ((unsigned short*)out)[i] = XK == 1 ? qm_to_f16(v) : qm_to_bf16(v);
}

// Values 8t..8t+7 of a 16-byte chunk: int8 (words 2t and 2t+1) or int4 (word t). Integers
// become floats without a conversion instruction (a quarter of the FMA rate, which bounded
// these kernels): the value plus an offset placed in the mantissa of 2^23, then the offset
// and 2^23 subtracted, exactly.
template <bool INT4> __device__ __forceinline__ void qm_decode8(const uint4& q, int t, float* v) {
  const unsigned w[4] = {q.x, q.y, q.z, q.w};
  if (INT4) {
    // Each nibble q + 8 (in 0..15): the even ones, then the odd ones, a byte each.
    const unsigned word = w[t] ^ 0x88888888u, lo = word & 0x0F0F0F0Fu, hi = (word >> 4) & 0x0F0F0F0Fu;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      v[2 * b] = __uint_as_float(__byte_perm(lo, 0x4B000000u, 0x7440u + b)) - 8388616.f;
      v[2 * b + 1] = __uint_as_float(__byte_perm(hi, 0x4B000000u, 0x7440u + b)) - 8388616.f;
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const unsigned word = w[2 * t + h] ^ 0x80808080u;  // each byte q + 128, in 0..255
#pragma unroll
      for (int u = 0; u < 4; ++u) v[4 * h + u] = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u + u)) - 8388736.f;
    }
  }
}

// Few rows (M <= 16): each channel's chunks of 16 bytes are streamed once (each weight byte
// read once), by SPLIT warps of a block taking turns at 32 chunks (one a lane) and summing
// their parts through shared memory at the end, in a fixed order; a warp serves C channels,
// reusing the inputs it reads (through the L1 cache) for all of them. A lane keeps AHEAD chunks
// of each channel in flight: it loads the next batch before it computes the one it holds (K is
// a constant, so the batches are known and the loads leave early). Blocks of QM_WARPS warps.
#define QM_WARPS 4
// VX: the inputs are read eight at a time (contiguous rows, aligned); WA: the weights are
// aligned for 16-byte loads (`qm_gemv` decides both once, so that no iteration carries the
// other path's instructions, predicated off).
template <int M, int C, int AHEAD, int SPLIT, int XK, int SK, bool INT4, bool VX, bool WA, int K, int GROUP>
__device__ __forceinline__ void qm_gemv_path(const void* x, long long x_off, long long rs, long long cs,
                                             const unsigned char* w, void* out, int N, long long row_bytes,
                                             long long scales, int groups) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % SPLIT;
  const int j0 = (blockIdx.x * (QM_WARPS / SPLIT) + warp / SPLIT) * C;
  constexpr int VALS = INT4 ? 32 : 16, CHUNKS = (K + VALS - 1) / VALS, FULL = K / VALS;
  constexpr int BATCHES = (CHUNKS + 32 * AHEAD * SPLIT - 1) / (32 * AHEAD * SPLIT);
  float acc[M][C];
#pragma unroll
  for (int r = 0; r < M; ++r)
#pragma unroll
    for (int ch = 0; ch < C; ++ch) acc[r][ch] = 0.f;
  uint4 cur[AHEAD][C], nxt[AHEAD][C];
  unsigned scur[AHEAD][C], snxt[AHEAD][C];
  // The chunk lane `lane` of this warp takes at step `i` of batch `b`.
  auto chunk = [&](int b, int i) { return ((b * AHEAD + i) * SPLIT + part) * 32 + lane; };
  // Batch `b`'s chunks of each channel (zeros past the row or the last channel: a warp past
  // the last channel walks nothing but still meets the others' shuffles and barrier) and the
  // bits of their scales.
  auto load = [&](int b, uint4 (&q)[AHEAD][C], unsigned (&sc)[AHEAD][C]) {
#pragma unroll
    for (int i = 0; i < AHEAD; ++i) {
      const int c = chunk(b, i);
#pragma unroll
      for (int ch = 0; ch < C; ++ch) {
        const bool in = c < CHUNKS && j0 + ch < N;
        const unsigned char* at = w + (long long)(j0 + ch) * row_bytes + 16LL * c;
        q[i][ch] = !in ? make_uint4(0, 0, 0, 0) : WA ? __ldcs((const uint4*)at) : qm_bytes<4>(at, true);
        // int4: the chunk lies in one group (groups are whole chunks); int8: scaled at the end.
        sc[i][ch] = INT4 && in ? qm_scale_bits<SK>(w, scales, (long long)(j0 + ch) * groups + (c * VALS) / GROUP, WA) : 0u;
      }
    }
  };
  load(0, cur, scur);
#pragma unroll 1
  for (int b = 0; b < BATCHES; ++b) {
    if (b + 1 < BATCHES) load(b + 1, nxt, snxt);
#pragma unroll
    for (int i = 0; i < AHEAD; ++i) {
      const int c = chunk(b, i);
      if (c >= CHUNKS) continue;
      float p[M][C];
#pragma unroll
      for (int r = 0; r < M; ++r)
#pragma unroll
        for (int ch = 0; ch < C; ++ch) p[r][ch] = 0.f;
      const long long i0 = (long long)c * VALS;
#pragma unroll
      for (int t = 0; t < VALS / 8; ++t) {
        float wv[C][8];
#pragma unroll
        for (int ch = 0; ch < C; ++ch) qm_decode8<INT4>(cur[i][ch], t, wv[ch]);
#pragma unroll
        for (int r = 0; r < M; ++r) {
          float xv[8];
          const long long at = x_off + r * rs;
          if (VX && (K % VALS == 0 || c < FULL)) {
            qm_x8<XK>(x, at + i0 + 8 * t, xv);
          } else {
#pragma unroll
            for (int u = 0; u < 8; ++u) {
              const long long k = i0 + 8 * t + u;
              xv[u] = k < K ? qm_x<XK>(x, at + k * cs) : 0.f;
            }
          }
#pragma unroll
          for (int ch = 0; ch < C; ++ch)
#pragma unroll
            for (int u = 0; u < 8; ++u) p[r][ch] = fmaf(xv[u], wv[ch][u], p[r][ch]);
        }
      }
#pragma unroll
      for (int ch = 0; ch < C; ++ch)
#pragma unroll
        for (int r = 0; r < M; ++r) {
          acc[r][ch] = INT4 ? fmaf(p[r][ch], qm_scale_of<SK>(scur[i][ch]), acc[r][ch]) : acc[r][ch] + p[r][ch];
        }
    }
#pragma unroll
    for (int i = 0; i < AHEAD; ++i)
#pragma unroll
      for (int ch = 0; ch < C; ++ch) {
        cur[i][ch] = nxt[i][ch];
        scur[i][ch] = snxt[i][ch];
      }
  }
#pragma unroll
  for (int r = 0; r < M; ++r)
#pragma unroll
    for (int ch = 0; ch < C; ++ch)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][ch] += __shfl_xor_sync(0xffffffffu, acc[r][ch], o);
  if (SPLIT > 1) {
    // The parts of one channel, summed in the order of the warps that computed them.
    __shared__ float parts[QM_WARPS][M][C];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < M; ++r)
#pragma unroll
        for (int ch = 0; ch < C; ++ch) parts[warp][r][ch] = acc[r][ch];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int ch = 0; ch < C; ++ch) {
        acc[r][ch] = parts[warp - part][r][ch];
        for (int q = 1; q < SPLIT; ++q) acc[r][ch] += parts[warp - part + q][r][ch];
      }
  }
  if (lane == 0 && part == 0) {
#pragma unroll
    for (int ch = 0; ch < C; ++ch) {
      if (j0 + ch >= N) continue;
      const float s = INT4 ? 1.f : qm_scale<SK>(w, scales, j0 + ch, WA);
      // (+ 0: an exact zero is +0, as the CPU's sum of dequantized terms gives.)
#pragma unroll
      for (int r = 0; r < M; ++r) qm_store<XK>(out, (long long)r * N + j0 + ch, (INT4 ? acc[r][ch] : acc[r][ch] * s) + 0.f);
    }
  }
}

template <int M, int C, int AHEAD, int SPLIT, int XK, int SK, bool INT4, bool VECX, int K, int GROUP>
__device__ __forceinline__ void qm_gemv(const void* x, long long x_off, long long rs, long long cs,
                                        const unsigned char* w, void* out, int N, long long row_bytes,
                                        long long scales, int groups) {
  const bool vx = VECX && (unsigned long long)x % 16 == 0, wa = (unsigned long long)w % 16 == 0;
#define QM_PATH(V, A) qm_gemv_path<M, C, AHEAD, SPLIT, XK, SK, INT4, V, A, K, GROUP>(x, x_off, rs, cs, w, out, N, row_bytes, scales, groups)
  if (vx && wa) QM_PATH(VECX, true);
  else if (wa) QM_PATH(false, true);
  else QM_PATH(false, false);
#undef QM_PATH
}

// Many rows: 64 x 64 tiles of the product, 256 threads of 4 x 4 elements each, over steps of
// 32 inputs staged in shared memory in f32 (the weights dequantized as they are staged).
#define QM_T 64
#define QM_KT 32
template <int XK, int SK, bool INT4>
__device__ __forceinline__ void qm_tiled(const void* x, long long x_off, long long rs, long long cs,
                                         const unsigned char* w, void* out, int M, int K, int N,
                                         long long row_bytes, long long scales, int groups, int group) {
  __shared__ float xs[QM_KT][QM_T + 4];
  __shared__ float ws[QM_KT][QM_T + 4];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int tiles_n = (N + QM_T - 1) / QM_T;
  const int m0 = (blockIdx.x / tiles_n) * QM_T, n0 = (blockIdx.x % tiles_n) * QM_T;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < K; k0 += QM_KT) {
    // Inputs: 64 rows x 32, eight a thread.
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int idx = tid + e * 256, r = idx / QM_KT, kk = idx % QM_KT;
      const int m = m0 + r, k = k0 + kk;
      xs[kk][r] = m < M && k < K ? qm_x<XK>(x, x_off + m * rs + (long long)k * cs) : 0.f;
    }
    // Weights: 64 channels x 32 inputs, eight values (one chunk of 4 or 8 bytes) a thread.
    {
      const int ch = tid / 4, part = tid % 4, j = n0 + ch, k = k0 + part * 8;
      float v[8];
      if (j < N && k < K) {
        const unsigned char* row = w + (long long)j * row_bytes;
        if (INT4) qm_decode8<true>(qm_bytes<1>(row + k / 2, false), 0, v);
        else qm_decode8<false>(qm_bytes<2>(row + k, false), 0, v);
        const float s = qm_scale<SK>(w, scales, (long long)j * groups + k / group, (unsigned long long)w % 16 == 0);
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = k + u < K ? v[u] * s : 0.f;
      } else {
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = 0.f;
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) ws[part * 8 + u][ch] = v[u];
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < QM_KT; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = xs[kk][ty * 4 + i];
        b[i] = ws[kk][tx * 4 + i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) acc[i][jj] = fmaf(a[i], b[jj], acc[i][jj]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int m = m0 + ty * 4 + i, n = n0 + tx * 4 + jj;
      if (m < M && n < N) qm_store<XK>(out, (long long)m * N + n, acc[i][jj]);
    }
}
