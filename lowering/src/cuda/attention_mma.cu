// Fused attention on tensor cores (f16 and bf16): the device code behind the entry points that
// `attention.rs` prints, after its preamble of constants (shape, tiling, each operand's strides
// and per-problem offset). Scores, products and the online softmax accumulate in f32; the
// probabilities (and ds) are rounded to the inputs' dtype before they multiply values, as the
// numeric contract allows. Tiles of q, k, v (and d_out) sit in shared memory, rows padded by 8
// elements so that ldmatrix reads are free of bank conflicts; the [sq, sk] scores live only in
// registers, one 16 x BK (or 16 x BQ) slab per warp at a time. Each output element is written by
// one thread; nothing is added atomically, so results do not depend on scheduling.
//
// A product with a probability (or ds) of zero is never formed for a hidden (masked) entry: in
// the tiles the causal mask cuts, the second operand of the second product is scanned, and
// where it holds a non-finite value the warp adds the visible terms one by one instead of with
// mma (`att_exact`), so that 0 * inf never reaches a sum. Rows and columns past the ends are
// zeros in shared memory and masked as hidden.

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "braid's attention of halves needs compute capability 8.0 or newer (mma.sync, cp.async)"
#endif

#if ATT_BF16
#define ATT_MMA "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#define ATT_EXP_BITS 0x7f80u
// Two floats rounded to bf16 and packed (the first in the low half).
__device__ __forceinline__ unsigned att_pack(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ float att_float(unsigned short bits) { return __uint_as_float((unsigned)bits << 16); }
#else
#define ATT_MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#define ATT_EXP_BITS 0x7c00u
__device__ __forceinline__ unsigned att_pack(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ float att_float(unsigned short bits) { return __half2float(__ushort_as_half(bits)); }
#endif

constexpr int ATT_THREADS = ATT_WARPS * 32;

// c += a * b for one m16n8k16 tile (a: 4 registers of a row-major 16x16, b: 2 of a 16x8).
__device__ __forceinline__ void att_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(ATT_MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 matrices of 16-bit elements from shared memory (lane l gives the address of row l % 8
// of matrix l / 8), plain or transposed.
__device__ __forceinline__ void att_ldsm(unsigned (&r)[4], const att_t* p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void att_ldsm_t(unsigned (&r)[4], const att_t* p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// 16 bytes from global to shared memory without passing through registers; complete (for this
// thread) after `att_cp_wait`, visible to the block after the barrier that follows.
__device__ __forceinline__ void att_cp16(att_t* s, const att_t* g) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(s);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(g));
}
__device__ __forceinline__ void att_cp_wait() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ bool att_aligned(const void* p) { return ((unsigned long long)p & 15) == 0; }

// Rows r0 .. r0 + ROWS of an operand (row `r` of this problem at element at + r * RS, column c at
// c * CS) into s[ROWS][ATT_LDS]: zeros past row `limit` and past column ATT_D (up to ATT_DP).
// With `vec` (unit column stride, rows and base 16-byte aligned, D a multiple of 8) by
// asynchronous 16-byte copies, else element by element.
template <int ROWS, long long RS, long long CS>
__device__ __forceinline__ void att_tile(att_t* s, const att_t* g, long long at, int r0, int limit, bool vec) {
  if (vec) {
    constexpr int CH = ATT_DP / 8;
    for (int i = threadIdx.x; i < ROWS * CH; i += ATT_THREADS) {
      const int r = i / CH, c = i % CH;
      att_t* dst = s + r * ATT_LDS + c * 8;
      if (r0 + r < limit && c * 8 < ATT_D) {
        att_cp16(dst, g + at + (long long)(r0 + r) * RS + c * 8);
      } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      }
    }
  } else {
    const unsigned short* gb = reinterpret_cast<const unsigned short*>(g);
    unsigned short* sb = reinterpret_cast<unsigned short*>(s);
    for (int i = threadIdx.x; i < ROWS * ATT_DP; i += ATT_THREADS) {
      const int r = i / ATT_DP, c = i % ATT_DP;
      unsigned short x = 0;
      if (r0 + r < limit && c < ATT_D) x = gb[at + (long long)(r0 + r) * RS + (long long)c * CS];
      sb[r * ATT_LDS + c] = x;
    }
  }
}

// Whether the first `rows` rows of a tile hold an infinity or a NaN (this thread's share).
__device__ __forceinline__ bool att_nonfinite(const att_t* s, int rows) {
  const unsigned short* sb = reinterpret_cast<const unsigned short*>(s);
  bool bad = false;
  for (int i = threadIdx.x; i < rows * ATT_D; i += ATT_THREADS) {
    bad |= (sb[(i / ATT_D) * ATT_LDS + i % ATT_D] & ATT_EXP_BITS) == ATT_EXP_BITS;
  }
  return bad;
}

// acc[16 MT x DP] += a[16 MT x K] * b[K x DP] for one warp: a in registers (`att_a_from_c`), b
// from a tile whose rows are the K index (b[k][n] at row k, column n, read transposed), for
// K = 16 KS. Each b fragment feeds all MT row slabs.
template <int MT, int KS>
__device__ __forceinline__ void att_ab_t(float (&acc)[MT][ATT_DP / 8][4], const unsigned (&a)[MT][KS][4],
                                         const att_t* b, int lane) {
#pragma unroll
  for (int kc = 0; kc < KS; ++kc) {
#pragma unroll
    for (int n2 = 0; n2 < ATT_DP / 16; ++n2) {
      unsigned bb[4];
      att_ldsm_t(bb, b + (kc * 16 + ((lane / 8) % 2) * 8 + lane % 8) * ATT_LDS + n2 * 16 + (lane / 16) * 8);
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        att_mma(acc[mi][2 * n2], a[mi][kc], bb[0], bb[1]);
        att_mma(acc[mi][2 * n2 + 1], a[mi][kc], bb[2], bb[3]);
      }
    }
  }
}

// s[16 MT x 8 NB] = a[16 MT x DP] * b^T for one warp: a's rows from shared memory (the warp's
// first row at `a`), b's 8 NB rows (the n index) from a tile whose columns are the shared DP
// index. Each b fragment feeds all MT row slabs.
template <int MT, int NB>
__device__ __forceinline__ void att_abt(float (&s)[MT][NB][4], const att_t* a, const att_t* b, int lane) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
    for (int n = 0; n < NB; ++n) s[mi][n][0] = s[mi][n][1] = s[mi][n][2] = s[mi][n][3] = 0.f;
  }
#pragma unroll
  for (int kk = 0; kk < ATT_DP / 16; ++kk) {
    unsigned af[MT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      att_ldsm(af[mi], a + (mi * 16 + lane % 16) * ATT_LDS + kk * 16 + (lane / 16) * 8);
    }
#pragma unroll
    for (int n2 = 0; n2 < NB / 2; ++n2) {
      unsigned bb[4];
      att_ldsm(bb, b + (n2 * 16 + (lane / 16) * 8 + lane % 8) * ATT_LDS + kk * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        att_mma(s[mi][2 * n2], af[mi], bb[0], bb[1]);
        att_mma(s[mi][2 * n2 + 1], af[mi], bb[2], bb[3]);
      }
    }
  }
}

// The accumulator fragments of a 16 x 16 KS slab as the A operand of the next product (rounded
// to the dtype): columns 16 kc .. 16 kc + 15 are n-blocks 2 kc and 2 kc + 1.
template <int MT, int KS>
__device__ __forceinline__ void att_a_from_c(unsigned (&a)[MT][KS][4], const float (&c)[MT][2 * KS][4]) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
    for (int kc = 0; kc < KS; ++kc) {
      a[mi][kc][0] = att_pack(c[mi][2 * kc][0], c[mi][2 * kc][1]);
      a[mi][kc][1] = att_pack(c[mi][2 * kc][2], c[mi][2 * kc][3]);
      a[mi][kc][2] = att_pack(c[mi][2 * kc + 1][0], c[mi][2 * kc + 1][1]);
      a[mi][kc][3] = att_pack(c[mi][2 * kc + 1][2], c[mi][2 * kc + 1][3]);
    }
  }
}

// The exact form of acc += a * b (see the file's head): a (16 x K, accumulator fragments) is
// rounded to the dtype and laid out in the warp's scratch `w` (16 rows of K), then each
// thread adds, for its own accumulator elements, the terms whose (row, k) `vis` says are
// visible, in order of k.
template <int K, typename Vis>
__device__ __forceinline__ void att_exact(float (&acc)[ATT_DP / 8][4], const float (&a)[K / 8][4], unsigned short* w,
                                          const att_t* b, int lane, Vis vis) {
  constexpr int LW = K;
  const int g = lane / 4, t4 = lane % 4;
  const unsigned short* bb = reinterpret_cast<const unsigned short*>(b);
  __syncwarp();
#pragma unroll
  for (int n = 0; n < K / 8; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      w[(g + (c / 2) * 8) * LW + n * 8 + 2 * t4 + c % 2] = (unsigned short)(att_pack(a[n][c], 0.f) & 0xffffu);
    }
  }
  __syncwarp();
#pragma unroll
  for (int n = 0; n < ATT_DP / 8; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int r = g + (c / 2) * 8, col = n * 8 + 2 * t4 + c % 2;
      float sum = acc[n][c];
#pragma unroll 1
      for (int k = 0; k < K; ++k) {
        if (vis(r, k)) sum = fmaf(att_float(w[r * LW + k]), att_float(bb[k * ATT_LDS + col]), sum);
      }
      acc[n][c] = sum;
    }
  }
  __syncwarp();
}

// Stores a warp's 16 ROWS16 x DP accumulator slabs (times `mul`, rounded) as rows row0 .. of a
// contiguous [problems, limit, D] output, staged through the warp's own rows `st` of a tile
// (no other warp reads them): 16-byte stores where the output allows, else element by element.
template <int ROWS16>
__device__ __forceinline__ void att_store(att_t* out, long long first, int row0, int limit,
                                          const float (&acc)[ROWS16][ATT_DP / 8][4], float mul, att_t* st, int lane) {
  const int g = lane / 4, t4 = lane % 4;
  __syncwarp();
#pragma unroll
  for (int mi = 0; mi < ROWS16; ++mi) {
#pragma unroll
    for (int n = 0; n < ATT_DP / 8; ++n) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned x = att_pack(acc[mi][n][2 * h] * mul, acc[mi][n][2 * h + 1] * mul);
        *reinterpret_cast<unsigned*>(st + (mi * 16 + g + 8 * h) * ATT_LDS + n * 8 + 2 * t4) = x;
      }
    }
  }
  __syncwarp();
  constexpr int ROWS = 16 * ROWS16;
  const int rows = min(ROWS, limit - row0);
  if constexpr (ATT_D % 8 == 0) {
    if (att_aligned(out)) {
      constexpr int CH = ATT_D / 8 > 0 ? ATT_D / 8 : 1;  // (the branch is dead where D < 8)
      for (int i = lane; i < rows * CH; i += 32) {
        const int r = i / CH, c = i % CH;
        *reinterpret_cast<uint4*>(out + (first + row0 + r) * ATT_D + c * 8) =
            *reinterpret_cast<const uint4*>(st + r * ATT_LDS + c * 8);
      }
      return;
    }
  }
  unsigned short* ob = reinterpret_cast<unsigned short*>(out);
  const unsigned short* sb = reinterpret_cast<const unsigned short*>(st);
  for (int i = lane; i < rows * ATT_D; i += 32) {
    ob[(first + row0 + i / ATT_D) * ATT_D + i % ATT_D] = sb[(i / ATT_D) * ATT_LDS + i % ATT_D];
  }
}
