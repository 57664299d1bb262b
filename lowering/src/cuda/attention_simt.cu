// Fused attention on CUDA cores (f32 and f64 inputs: no tensor cores, so no TF32): the device
// code behind the entry points that `attention.rs` prints after its preamble. Blocks of 128
// threads, 4 per row: a block owns 32 query rows (the forward pass and the query gradient) or
// 32 keys (the key and value gradients) and walks tiles of the other side through shared memory,
// where tiles are widened to the compute type (f32, f64 for f64) with rows padded by one element.
// A thread computes scores for every fourth key (or query) of a tile and owns every fourth
// column of its row's accumulators; the quad of threads sharing a row combines maxima and sums
// by shuffles. Products with probabilities skip hidden entries entirely (the loops stop at the
// last visible key or start at the first visible query), so no 0 * inf enters a sum. Each output
// element is written by one thread, no atomics.

constexpr int ATT_THREADS = 128;
constexpr int ATT_ROWS = 32;  // rows per block: 4 threads each
constexpr int ATT_NC = ATT_DP / 4;  // accumulator columns per thread
constexpr int ATT_LDS = ATT_DP + 1;

__device__ __forceinline__ float att_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ double att_exp2(double x) { return exp2(x); }
__device__ __forceinline__ float att_log(float x) { return logf(x); }
__device__ __forceinline__ double att_log(double x) { return log(x); }
__device__ __forceinline__ float att_fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double att_fma(double a, double b, double c) { return fma(a, b, c); }
__device__ __forceinline__ float att_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double att_max(double a, double b) { return fmax(a, b); }

__device__ __forceinline__ bool att_visible(int query, int key) {
  return key < ATT_SK && query < ATT_SQ && (!ATT_CAUSAL || key <= query);
}

// Rows r0 .. r0 + rows of an operand (row r of this problem at element at + r * RS, column c at
// c * CS) into s[rows][ATT_LDS] in the compute type: zeros past row `limit` and column ATT_D.
template <long long RS, long long CS>
__device__ __forceinline__ void att_tile(att_r* s, const att_t* g, long long at, int r0, int rows, int limit) {
  for (int i = threadIdx.x; i < rows * ATT_DP; i += ATT_THREADS) {
    const int r = i / ATT_DP, c = i % ATT_DP;
    s[r * ATT_LDS + c] = r0 + r < limit && c < ATT_D ? (att_r)g[at + (long long)(r0 + r) * RS + (long long)c * CS] : (att_r)0;
  }
}

__device__ __forceinline__ att_r att_dot(const att_r* a, const att_r* b) {
  att_r sum = 0;
#pragma unroll 4
  for (int c = 0; c < ATT_D; ++c) sum = att_fma(a[c], b[c], sum);
  return sum;
}

// A quad's combined maximum or sum (the 4 lanes sharing a row).
__device__ __forceinline__ att_r att_quad_max(att_r x) {
  x = att_max(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return att_max(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ att_r att_quad_sum(att_r x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A thread's accumulator columns (times `mul`) to row `row` of a contiguous [.., D] output.
__device__ __forceinline__ void att_put(att_t* out, long long row, const att_r (&acc)[ATT_NC], att_r mul, int t4) {
#pragma unroll
  for (int c = 0; c < ATT_NC; ++c) {
    const int col = t4 + 4 * c;
    if (col < ATT_D) out[row * ATT_D + col] = (att_t)(acc[c] * mul);
  }
}

// @@forward
// The forward pass: block (problem, 32 query rows), key tiles of ATT_BK, online softmax.
template <bool OUT, bool LSE>
__device__ __forceinline__ void att_forward(const att_t* q, const att_t* k, const att_t* v, att_t* out, att_r* lse) {
  extern __shared__ __align__(16) unsigned char att_smem[];
  constexpr int BK = ATT_BK, LP = ATT_BK + 1;
  att_r* qs = reinterpret_cast<att_r*>(att_smem);
  att_r* ks = qs + ATT_ROWS * ATT_LDS;
  att_r* vs = ks + BK * ATT_LDS;
  att_r* ps = vs + BK * ATT_LDS;
  const int tiles = (ATT_SQ + ATT_ROWS - 1) / ATT_ROWS;
  const long long b = blockIdx.x % ATT_PROBLEMS;
  const int q0 = (tiles - 1 - (int)(blockIdx.x / ATT_PROBLEMS)) * ATT_ROWS;
  const int r = threadIdx.x / 4, t4 = threadIdx.x % 4, query = q0 + r;
  const long long qa = att_at_q(b), ka = att_at_k(b), va = att_at_v(b);
  att_tile<ATT_Q_RS, ATT_Q_CS>(qs, q, qa, q0, ATT_ROWS, ATT_SQ);
  const int key_end = ATT_CAUSAL ? min(q0 + ATT_ROWS, ATT_SK) : ATT_SK;
  att_r o[ATT_NC], m = ATT_NEG_INF, l = 0;
#pragma unroll
  for (int c = 0; c < ATT_NC; ++c) o[c] = 0;
  for (int k0 = 0; k0 < key_end; k0 += BK) {
    __syncthreads();
    att_tile<ATT_K_RS, ATT_K_CS>(ks, k, ka, k0, BK, ATT_SK);
    att_tile<ATT_V_RS, ATT_V_CS>(vs, v, va, k0, BK, ATT_SK);
    __syncthreads();
    att_r s[BK / 4], mx = m;
#pragma unroll
    for (int c = 0; c < BK / 4; ++c) {
      const int j = t4 + 4 * c;
      s[c] = att_visible(query, k0 + j) ? att_dot(qs + r * ATT_LDS, ks + j * ATT_LDS) : ATT_NEG_INF;
      mx = att_max(mx, s[c]);
    }
    mx = att_quad_max(mx);
    const att_r ms = mx == ATT_NEG_INF ? (att_r)0 : mx * ATT_SCALE_LOG2;
    const att_r alpha = att_exp2(m * ATT_SCALE_LOG2 - ms);
    m = mx;
    att_r sum = 0;
#pragma unroll
    for (int c = 0; c < BK / 4; ++c) {
      const att_r p = att_exp2(att_fma(s[c], ATT_SCALE_LOG2, -ms));
      ps[r * LP + t4 + 4 * c] = p;
      sum += p;
    }
    l = l * alpha + att_quad_sum(sum);
#pragma unroll
    for (int c = 0; c < ATT_NC; ++c) o[c] *= alpha;
    __syncwarp();
    // Only the visible keys of the tile: 0 .. n.
    const int n = query >= ATT_SQ ? 0 : min(min(BK, ATT_SK - k0), ATT_CAUSAL ? query - k0 + 1 : BK);
    for (int j = 0; j < n; ++j) {
      const att_r p = ps[r * LP + j];
#pragma unroll
      for (int c = 0; c < ATT_NC; ++c) o[c] = att_fma(p, vs[j * ATT_LDS + t4 + 4 * c], o[c]);
    }
  }
  if (query < ATT_SQ) {
    if (LSE && t4 == 0) lse[b * ATT_SQ + query] = att_fma(m, ATT_SCALE, att_log(l));
    if (OUT) att_put(out, b * ATT_SQ + query, o, (att_r)1 / l, t4);
  }
}

// @@grad_q
// The query gradient: block (problem, 32 query rows), key tiles of ATT_BK.
__device__ __forceinline__ void att_grad_q(const att_t* q, const att_t* k, const att_t* v, const att_t* d_out,
                                           const att_r* lse, const att_r* delta, att_t* dq) {
  extern __shared__ __align__(16) unsigned char att_smem[];
  constexpr int BK = ATT_BK, LP = ATT_BK + 1;
  att_r* qs = reinterpret_cast<att_r*>(att_smem);
  att_r* os = qs + ATT_ROWS * ATT_LDS;
  att_r* ks = os + ATT_ROWS * ATT_LDS;
  att_r* vs = ks + BK * ATT_LDS;
  att_r* ps = vs + BK * ATT_LDS;
  const int tiles = (ATT_SQ + ATT_ROWS - 1) / ATT_ROWS;
  const long long b = blockIdx.x % ATT_PROBLEMS;
  const int q0 = (tiles - 1 - (int)(blockIdx.x / ATT_PROBLEMS)) * ATT_ROWS;
  const int r = threadIdx.x / 4, t4 = threadIdx.x % 4, query = q0 + r;
  const long long ka = att_at_k(b), va = att_at_v(b);
  att_tile<ATT_Q_RS, ATT_Q_CS>(qs, q, att_at_q(b), q0, ATT_ROWS, ATT_SQ);
  att_tile<ATT_DO_RS, ATT_DO_CS>(os, d_out, att_at_do(b), q0, ATT_ROWS, ATT_SQ);
  const att_r lse2 = query < ATT_SQ ? lse[att_at_lse(b) + query * ATT_LSE_RS] * ATT_LOG2E : (att_r)0;
  const att_r dl = query < ATT_SQ ? delta[att_at_delta(b) + query * ATT_DELTA_RS] : (att_r)0;
  const int key_end = ATT_CAUSAL ? min(q0 + ATT_ROWS, ATT_SK) : ATT_SK;
  att_r acc[ATT_NC];
#pragma unroll
  for (int c = 0; c < ATT_NC; ++c) acc[c] = 0;
  for (int k0 = 0; k0 < key_end; k0 += BK) {
    __syncthreads();
    att_tile<ATT_K_RS, ATT_K_CS>(ks, k, ka, k0, BK, ATT_SK);
    att_tile<ATT_V_RS, ATT_V_CS>(vs, v, va, k0, BK, ATT_SK);
    __syncthreads();
#pragma unroll
    for (int c = 0; c < BK / 4; ++c) {
      const int j = t4 + 4 * c;
      att_r ds = 0;
      if (att_visible(query, k0 + j)) {
        const att_r p = att_exp2(att_fma(att_dot(qs + r * ATT_LDS, ks + j * ATT_LDS), ATT_SCALE_LOG2, -lse2));
        ds = p * (att_dot(os + r * ATT_LDS, vs + j * ATT_LDS) - dl);
      }
      ps[r * LP + j] = ds;
    }
    __syncwarp();
    const int n = query >= ATT_SQ ? 0 : min(min(BK, ATT_SK - k0), ATT_CAUSAL ? query - k0 + 1 : BK);
    for (int j = 0; j < n; ++j) {
      const att_r ds = ps[r * LP + j];
#pragma unroll
      for (int c = 0; c < ATT_NC; ++c) acc[c] = att_fma(ds, ks[j * ATT_LDS + t4 + 4 * c], acc[c]);
    }
  }
  if (query < ATT_SQ) att_put(dq, b * ATT_SQ + query, acc, ATT_SCALE, t4);
}

// @@grad_kv
// The key and value gradients: block (problem, 32 keys), query tiles of ATT_BQ; keys no query
// sees get zeros.
template <bool DK, bool DV>
__device__ __forceinline__ void att_grad_kv(const att_t* q, const att_t* k, const att_t* v, const att_t* d_out,
                                            const att_r* lse, const att_r* delta, att_t* dk, att_t* dv) {
  extern __shared__ __align__(16) unsigned char att_smem[];
  constexpr int BQ = ATT_BQ, LP = ATT_BQ + 1;
  att_r* ks = reinterpret_cast<att_r*>(att_smem);
  att_r* vs = ks + ATT_ROWS * ATT_LDS;
  att_r* qs = vs + ATT_ROWS * ATT_LDS;
  att_r* os = qs + BQ * ATT_LDS;
  att_r* ps = os + BQ * ATT_LDS;
  att_r* dss = ps + ATT_ROWS * LP;
  att_r* ls = dss + ATT_ROWS * LP;
  att_r* dls = ls + BQ;
  const long long b = blockIdx.x % ATT_PROBLEMS;
  const int k0 = (int)(blockIdx.x / ATT_PROBLEMS) * ATT_ROWS;
  const int r = threadIdx.x / 4, t4 = threadIdx.x % 4, key = k0 + r;
  const long long qa = att_at_q(b), oa = att_at_do(b), la = att_at_lse(b), da = att_at_delta(b);
  att_tile<ATT_K_RS, ATT_K_CS>(ks, k, att_at_k(b), k0, ATT_ROWS, ATT_SK);
  att_tile<ATT_V_RS, ATT_V_CS>(vs, v, att_at_v(b), k0, ATT_ROWS, ATT_SK);
  const int first = ATT_CAUSAL ? min(k0, ATT_SQ) / BQ * BQ : 0;
  att_r gk[ATT_NC], gv[ATT_NC];
#pragma unroll
  for (int c = 0; c < ATT_NC; ++c) gk[c] = gv[c] = 0;
  for (int i0 = first; i0 < ATT_SQ; i0 += BQ) {
    __syncthreads();
    att_tile<ATT_Q_RS, ATT_Q_CS>(qs, q, qa, i0, BQ, ATT_SQ);
    att_tile<ATT_DO_RS, ATT_DO_CS>(os, d_out, oa, i0, BQ, ATT_SQ);
    for (int i = threadIdx.x; i < BQ; i += ATT_THREADS) {
      const bool in = i0 + i < ATT_SQ;
      ls[i] = in ? lse[la + (i0 + i) * ATT_LSE_RS] * ATT_LOG2E : (att_r)0;
      dls[i] = in ? delta[da + (i0 + i) * ATT_DELTA_RS] : (att_r)0;
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < BQ / 4; ++c) {
      const int i = t4 + 4 * c;
      att_r p = 0, ds = 0;
      if (att_visible(i0 + i, key)) {
        p = att_exp2(att_fma(att_dot(ks + r * ATT_LDS, qs + i * ATT_LDS), ATT_SCALE_LOG2, -ls[i]));
        ds = p * (att_dot(vs + r * ATT_LDS, os + i * ATT_LDS) - dls[i]);
      }
      ps[r * LP + i] = p;
      dss[r * LP + i] = ds;
    }
    __syncwarp();
    // Only the visible queries of the tile: from the key on (causal) to the last in range.
    const int from = key >= ATT_SK ? BQ : ATT_CAUSAL ? max(0, key - i0) : 0;
    const int to = min(BQ, ATT_SQ - i0);
    for (int i = from; i < to; ++i) {
      const att_r p = ps[r * LP + i], ds = dss[r * LP + i];
#pragma unroll
      for (int c = 0; c < ATT_NC; ++c) {
        if (DV) gv[c] = att_fma(p, os[i * ATT_LDS + t4 + 4 * c], gv[c]);
        if (DK) gk[c] = att_fma(ds, qs[i * ATT_LDS + t4 + 4 * c], gk[c]);
      }
    }
  }
  if (key < ATT_SK) {
    if (DK) att_put(dk, b * ATT_SK + key, gk, ATT_SCALE, t4);
    if (DV) att_put(dv, b * ATT_SK + key, gv, (att_r)1, t4);
  }
}
