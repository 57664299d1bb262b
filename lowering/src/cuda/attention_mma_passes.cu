// The three passes of fused attention on tensor cores (after `attention_mma.cu`'s helpers).
// Blocks take the longest work first: causal forward and query-gradient blocks in order of
// descending query tile, key/value-gradient blocks in order of ascending key tile. Tiles are
// double-buffered: the next one is copied in while the current one is multiplied.

constexpr int ATT_MT = ATT_MW;  // 16-row slabs per warp

// Whether key `key` is visible from query `query` (in range, and not after it when causal).
__device__ __forceinline__ bool att_visible(int query, int key) {
  return key < ATT_SK && query < ATT_SQ && (!ATT_CAUSAL || key <= query);
}

// @@forward
// The forward pass: block (problem, query tile of ATT_BQ rows), each warp 16 MT rows, walking
// key tiles of ATT_BK with an online softmax.
template <bool OUT, bool LSE>
__device__ __forceinline__ void att_forward(const att_t* q, const att_t* k, const att_t* v, att_t* out, float* lse) {
  extern __shared__ __align__(16) unsigned char att_smem[];
  constexpr int BQ = ATT_BQ, BK = ATT_BK, NB = BK / 8, ND = ATT_DP / 8;
  att_t* qs = reinterpret_cast<att_t*>(att_smem);
  att_t* kv = qs + BQ * ATT_LDS;  // two buffers, each a k tile then a v tile
  constexpr int PAIR = 2 * BK * ATT_LDS;
  static_assert(!ATT_CAUSAL || ATT_SCRATCH_OWN || ATT_WARPS * 16 * BK <= PAIR, "the exact path's scratch fits in a buffer");
  const int tiles = (ATT_SQ + BQ - 1) / BQ;
  const long long b = blockIdx.x % ATT_PROBLEMS;
  const int q0 = (tiles - 1 - (int)(blockIdx.x / ATT_PROBLEMS)) * BQ;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int row0 = warp * 16 * ATT_MT;
  const long long qa = att_at_q(b), ka = att_at_k(b), va = att_at_v(b);
  const bool qv = ATT_Q_VEC && att_aligned(q), kw = ATT_K_VEC && att_aligned(k), vw = ATT_V_VEC && att_aligned(v);
  const int key_end = ATT_CAUSAL ? min(q0 + BQ, ATT_SK) : ATT_SK;
  const int ntiles = (key_end + BK - 1) / BK;
  auto fetch = [&](int buf, int k0) {
    att_tile<BK, ATT_K_RS, ATT_K_CS>(kv + buf * PAIR, k, ka, k0, ATT_SK, kw);
    att_tile<BK, ATT_V_RS, ATT_V_CS>(kv + buf * PAIR + BK * ATT_LDS, v, va, k0, ATT_SK, vw);
  };
  att_tile<BQ, ATT_Q_RS, ATT_Q_CS>(qs, q, qa, q0, ATT_SQ, qv);
  fetch(0, 0);
  float o[ATT_MT][ND][4], m[ATT_MT][2], l[ATT_MT][2];
#pragma unroll
  for (int mi = 0; mi < ATT_MT; ++mi) {
#pragma unroll
    for (int n = 0; n < ND; ++n) o[mi][n][0] = o[mi][n][1] = o[mi][n][2] = o[mi][n][3] = 0.f;
    m[mi][0] = m[mi][1] = ATT_NEG_INF;
    l[mi][0] = l[mi][1] = 0.f;
  }
  for (int t = 0; t < ntiles; ++t) {
    const int k0 = t * BK, buf = t & 1;
    const att_t* kt = kv + buf * PAIR;
    const att_t* vt = kt + BK * ATT_LDS;
    att_cp_wait();
    __syncthreads();
    // In a tile the mask cuts, a non-finite value takes the exact path, whose scratch is the
    // other buffer (filled after it) or, where that is too small, memory of its own.
    const bool diagonal = ATT_CAUSAL && k0 + BK - 1 > q0;
    const bool exact = diagonal && __syncthreads_or(att_nonfinite(vt, min(BK, ATT_SK - k0)));
    if (t + 1 < ntiles && !exact) fetch(buf ^ 1, k0 + BK);
    float s[ATT_MT][NB][4];
    att_abt<ATT_MT, NB>(s, qs + row0 * ATT_LDS, kt, lane);
    if (diagonal || k0 + BK > ATT_SK) {
#pragma unroll
      for (int mi = 0; mi < ATT_MT; ++mi) {
#pragma unroll
        for (int n = 0; n < NB; ++n) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int query = q0 + row0 + mi * 16 + g + (c / 2) * 8, key = k0 + n * 8 + 2 * t4 + c % 2;
            if (key >= ATT_SK || (ATT_CAUSAL && key > query)) s[mi][n][c] = ATT_NEG_INF;
          }
        }
      }
    }
    // The online softmax: new maxima (over the quad of lanes sharing a row), rescaled sums.
#pragma unroll
    for (int mi = 0; mi < ATT_MT; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m[mi][h];
#pragma unroll
        for (int n = 0; n < NB; ++n) mx = fmaxf(mx, fmaxf(s[mi][n][2 * h], s[mi][n][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float ms = mx == ATT_NEG_INF ? 0.f : mx * ATT_SCALE_LOG2;
        const float alpha = exp2f(m[mi][h] * ATT_SCALE_LOG2 - ms);
        m[mi][h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < NB; ++n) {
#pragma unroll
          for (int c = 2 * h; c < 2 * h + 2; ++c) {
            s[mi][n][c] = exp2f(fmaf(s[mi][n][c], ATT_SCALE_LOG2, -ms));
            sum += s[mi][n][c];
          }
        }
        l[mi][h] = l[mi][h] * alpha + sum;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
          o[mi][n][2 * h] *= alpha;
          o[mi][n][2 * h + 1] *= alpha;
        }
      }
    }
    if (!exact) {
      unsigned pa[ATT_MT][BK / 16][4];
      att_a_from_c<ATT_MT, BK / 16>(pa, s);
      att_ab_t<ATT_MT, BK / 16>(o, pa, vt, lane);
    } else {
#pragma unroll
      for (int mi = 0; mi < ATT_MT; ++mi) {
        const int first = q0 + row0 + mi * 16;
        att_exact<BK>(o[mi], s[mi], reinterpret_cast<unsigned short*>(kv + (ATT_SCRATCH_OWN ? 2 : buf ^ 1) * PAIR) + warp * 16 * BK,
                      vt, lane, [&](int r, int j) { return att_visible(first + r, k0 + j); });
      }
      __syncthreads();
      if (t + 1 < ntiles) fetch(buf ^ 1, k0 + BK);
    }
  }
  // Row sums over the quad, then the log-sum-exp (natural log) and the normalised output.
  float inv[ATT_MT][2];
#pragma unroll
  for (int mi = 0; mi < ATT_MT; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = l[mi][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      inv[mi][h] = 1.f / sum;
      const int query = q0 + row0 + mi * 16 + g + 8 * h;
      if (LSE && t4 == 0 && query < ATT_SQ) lse[b * ATT_SQ + query] = fmaf(m[mi][h], ATT_SCALE, logf(sum));
    }
  }
  // No tile walked (no keys; or, for key and value gradients, no query that sees these keys):
  // the tiles' asynchronous copies may still be landing in the rows the stores stage through,
  // and no barrier has ordered them (compute-sanitizer racecheck found this).
  if (ntiles == 0) {
    att_cp_wait();
    __syncthreads();
  }
  if (OUT) {
#pragma unroll
    for (int mi = 0; mi < ATT_MT; ++mi) {
#pragma unroll
      for (int n = 0; n < ND; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) o[mi][n][c] *= inv[mi][c / 2];
      }
    }
    att_store<ATT_MT>(out, b * ATT_SQ + q0, row0, ATT_SQ - q0, o, 1.f, qs + row0 * ATT_LDS, lane);
  }
}

// @@grad_q
// The query gradient: block (problem, query tile of ATT_BQ rows), each warp 16 MT rows, walking
// key tiles: P = exp(s - lse), ds = P (dO . v - delta), dq += ds k, dq * scale at the end.
__device__ __forceinline__ void att_grad_q(const att_t* q, const att_t* k, const att_t* v, const att_t* d_out,
                                           const float* lse, const float* delta, att_t* dq) {
  extern __shared__ __align__(16) unsigned char att_smem[];
  constexpr int BQ = ATT_BQ, BK = ATT_BK, NB = BK / 8, ND = ATT_DP / 8;
  att_t* qs = reinterpret_cast<att_t*>(att_smem);
  att_t* os = qs + BQ * ATT_LDS;
  att_t* kv = os + BQ * ATT_LDS;  // two buffers, each a k tile then a v tile
  constexpr int PAIR = 2 * BK * ATT_LDS;
  static_assert(!ATT_CAUSAL || ATT_SCRATCH_OWN || ATT_WARPS * 16 * BK <= PAIR, "the exact path's scratch fits in a buffer");
  const int tiles = (ATT_SQ + BQ - 1) / BQ;
  const long long b = blockIdx.x % ATT_PROBLEMS;
  const int q0 = (tiles - 1 - (int)(blockIdx.x / ATT_PROBLEMS)) * BQ;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int row0 = warp * 16 * ATT_MT;
  const long long qa = att_at_q(b), ka = att_at_k(b), va = att_at_v(b), oa = att_at_do(b);
  const bool qv = ATT_Q_VEC && att_aligned(q), kw = ATT_K_VEC && att_aligned(k), vw = ATT_V_VEC && att_aligned(v),
             ov = ATT_DO_VEC && att_aligned(d_out);
  const int key_end = ATT_CAUSAL ? min(q0 + BQ, ATT_SK) : ATT_SK;
  const int ntiles = (key_end + BK - 1) / BK;
  auto fetch = [&](int buf, int k0) {
    att_tile<BK, ATT_K_RS, ATT_K_CS>(kv + buf * PAIR, k, ka, k0, ATT_SK, kw);
    att_tile<BK, ATT_V_RS, ATT_V_CS>(kv + buf * PAIR + BK * ATT_LDS, v, va, k0, ATT_SK, vw);
  };
  att_tile<BQ, ATT_Q_RS, ATT_Q_CS>(qs, q, qa, q0, ATT_SQ, qv);
  att_tile<BQ, ATT_DO_RS, ATT_DO_CS>(os, d_out, oa, q0, ATT_SQ, ov);
  fetch(0, 0);
  // This thread's rows' statistics: lse in log2 units, and delta (zeros past the end).
  float lse2[ATT_MT][2], dl[ATT_MT][2], acc[ATT_MT][ND][4];
  const long long la = att_at_lse(b), da = att_at_delta(b);
#pragma unroll
  for (int mi = 0; mi < ATT_MT; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int query = q0 + row0 + mi * 16 + g + 8 * h;
      lse2[mi][h] = query < ATT_SQ ? lse[la + query * ATT_LSE_RS] * ATT_LOG2E : 0.f;
      dl[mi][h] = query < ATT_SQ ? delta[da + query * ATT_DELTA_RS] : 0.f;
    }
#pragma unroll
    for (int n = 0; n < ND; ++n) acc[mi][n][0] = acc[mi][n][1] = acc[mi][n][2] = acc[mi][n][3] = 0.f;
  }
  for (int t = 0; t < ntiles; ++t) {
    const int k0 = t * BK, buf = t & 1;
    const att_t* kt = kv + buf * PAIR;
    const att_t* vt = kt + BK * ATT_LDS;
    att_cp_wait();
    __syncthreads();
    const bool diagonal = ATT_CAUSAL && k0 + BK - 1 > q0;
    const bool exact = diagonal && __syncthreads_or(att_nonfinite(kt, min(BK, ATT_SK - k0)));
    if (t + 1 < ntiles && !exact) fetch(buf ^ 1, k0 + BK);
    const bool masked = diagonal || k0 + BK > ATT_SK;
    float s[ATT_MT][NB][4], dp[ATT_MT][NB][4];
    att_abt<ATT_MT, NB>(s, qs + row0 * ATT_LDS, kt, lane);
    att_abt<ATT_MT, NB>(dp, os + row0 * ATT_LDS, vt, lane);
#pragma unroll
    for (int mi = 0; mi < ATT_MT; ++mi) {
#pragma unroll
      for (int n = 0; n < NB; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int query = q0 + row0 + mi * 16 + g + (c / 2) * 8, key = k0 + n * 8 + 2 * t4 + c % 2;
          const bool vis = !masked || att_visible(query, key);
          const float p = vis ? exp2f(fmaf(s[mi][n][c], ATT_SCALE_LOG2, -lse2[mi][c / 2])) : 0.f;
          s[mi][n][c] = vis ? p * (dp[mi][n][c] - dl[mi][c / 2]) : 0.f;
        }
      }
    }
    if (!exact) {
      unsigned da_[ATT_MT][BK / 16][4];
      att_a_from_c<ATT_MT, BK / 16>(da_, s);
      att_ab_t<ATT_MT, BK / 16>(acc, da_, kt, lane);
    } else {
#pragma unroll
      for (int mi = 0; mi < ATT_MT; ++mi) {
        const int first = q0 + row0 + mi * 16;
        att_exact<BK>(acc[mi], s[mi], reinterpret_cast<unsigned short*>(kv + (ATT_SCRATCH_OWN ? 2 : buf ^ 1) * PAIR) + warp * 16 * BK,
                      kt, lane, [&](int r, int j) { return att_visible(first + r, k0 + j); });
      }
      __syncthreads();
      if (t + 1 < ntiles) fetch(buf ^ 1, k0 + BK);
    }
  }
  // No tile walked (no keys; or, for key and value gradients, no query that sees these keys):
  // the tiles' asynchronous copies may still be landing in the rows the stores stage through,
  // and no barrier has ordered them (compute-sanitizer racecheck found this).
  if (ntiles == 0) {
    att_cp_wait();
    __syncthreads();
  }
  att_store<ATT_MT>(dq, b * ATT_SQ + q0, row0, ATT_SQ - q0, acc, ATT_SCALE, qs + row0 * ATT_LDS, lane);
}

// @@grad_kv
// The key and value gradients: block (problem, key tile of ATT_BK rows), each warp 16 MT keys,
// walking query tiles of ATT_BQ: P^T = exp(s^T - lse), dv += P^T dO, ds^T = P^T (v . dO -
// delta), dk += ds^T q, dk * scale at the end. Keys no query sees get zeros.
template <bool DK, bool DV>
__device__ __forceinline__ void att_grad_kv(const att_t* q, const att_t* k, const att_t* v, const att_t* d_out,
                                            const float* lse, const float* delta, att_t* dk, att_t* dv) {
  extern __shared__ __align__(16) unsigned char att_smem[];
  constexpr int BQ = ATT_BQ, BK = ATT_BK, NB = BQ / 8, ND = ATT_DP / 8;
  att_t* ks = reinterpret_cast<att_t*>(att_smem);
  att_t* vs = ks + BK * ATT_LDS;
  att_t* qo = vs + BK * ATT_LDS;  // two buffers, each a q tile then a d_out tile
  constexpr int PAIR = 2 * BQ * ATT_LDS;
  static_assert(!ATT_CAUSAL || ATT_SCRATCH_OWN || ATT_WARPS * 16 * BQ <= PAIR, "the exact path's scratch fits in a buffer");
  float* ls = reinterpret_cast<float*>(qo + 2 * PAIR);  // two buffers of lse (log2 units)
  float* ds = ls + 2 * BQ;                              // two buffers of delta
  const long long b = blockIdx.x % ATT_PROBLEMS;
  const int k0 = (int)(blockIdx.x / ATT_PROBLEMS) * BK;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int row0 = warp * 16 * ATT_MT;
  const long long qa = att_at_q(b), ka = att_at_k(b), va = att_at_v(b), oa = att_at_do(b);
  const long long la = att_at_lse(b), da = att_at_delta(b);
  const bool qv = ATT_Q_VEC && att_aligned(q), kw = ATT_K_VEC && att_aligned(k), vw = ATT_V_VEC && att_aligned(v),
             ov = ATT_DO_VEC && att_aligned(d_out);
  // Causal: queries before the tile's first key see none of it.
  const int first = ATT_CAUSAL ? min(k0, ATT_SQ) / BQ * BQ : 0;
  const int ntiles = (ATT_SQ - first + BQ - 1) / BQ;
  auto fetch = [&](int buf, int i0) {
    att_tile<BQ, ATT_Q_RS, ATT_Q_CS>(qo + buf * PAIR, q, qa, i0, ATT_SQ, qv);
    att_tile<BQ, ATT_DO_RS, ATT_DO_CS>(qo + buf * PAIR + BQ * ATT_LDS, d_out, oa, i0, ATT_SQ, ov);
    for (int i = threadIdx.x; i < BQ; i += ATT_THREADS) {
      const bool in = i0 + i < ATT_SQ;
      ls[buf * BQ + i] = in ? lse[la + (i0 + i) * ATT_LSE_RS] * ATT_LOG2E : 0.f;
      ds[buf * BQ + i] = in ? delta[da + (i0 + i) * ATT_DELTA_RS] : 0.f;
    }
  };
  att_tile<BK, ATT_K_RS, ATT_K_CS>(ks, k, ka, k0, ATT_SK, kw);
  att_tile<BK, ATT_V_RS, ATT_V_CS>(vs, v, va, k0, ATT_SK, vw);
  if (ntiles > 0) fetch(0, first);
  float gk[ATT_MT][ND][4], gv[ATT_MT][ND][4];
#pragma unroll
  for (int mi = 0; mi < ATT_MT; ++mi) {
#pragma unroll
    for (int n = 0; n < ND; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) gk[mi][n][c] = gv[mi][n][c] = 0.f;
    }
  }
  for (int t = 0; t < ntiles; ++t) {
    const int i0 = first + t * BQ, buf = t & 1;
    const att_t* qt = qo + buf * PAIR;
    const att_t* ot = qt + BQ * ATT_LDS;
    att_cp_wait();
    __syncthreads();
    const int rows = min(BQ, ATT_SQ - i0);
    const bool diagonal = ATT_CAUSAL && i0 < k0 + BK - 1;
    const bool exact = diagonal && __syncthreads_or(att_nonfinite(qt, rows) || att_nonfinite(ot, rows));
    if (t + 1 < ntiles && !exact) fetch(buf ^ 1, i0 + BQ);
    const bool masked = diagonal || i0 + BQ > ATT_SQ;
    float s[ATT_MT][NB][4], dp[ATT_MT][NB][4];
    att_abt<ATT_MT, NB>(s, ks + row0 * ATT_LDS, qt, lane);
    att_abt<ATT_MT, NB>(dp, vs + row0 * ATT_LDS, ot, lane);
#pragma unroll
    for (int mi = 0; mi < ATT_MT; ++mi) {
#pragma unroll
      for (int n = 0; n < NB; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int key = k0 + row0 + mi * 16 + g + (c / 2) * 8, col = n * 8 + 2 * t4 + c % 2;
          const bool vis = !masked || att_visible(i0 + col, key);
          const float p = vis ? exp2f(fmaf(s[mi][n][c], ATT_SCALE_LOG2, -ls[buf * BQ + col])) : 0.f;
          s[mi][n][c] = p;
          dp[mi][n][c] = vis ? p * (dp[mi][n][c] - ds[buf * BQ + col]) : 0.f;
        }
      }
    }
    if (!exact) {
      unsigned fa[ATT_MT][BQ / 16][4];
      if (DV) {
        att_a_from_c<ATT_MT, BQ / 16>(fa, s);
        att_ab_t<ATT_MT, BQ / 16>(gv, fa, ot, lane);
      }
      if (DK) {
        att_a_from_c<ATT_MT, BQ / 16>(fa, dp);
        att_ab_t<ATT_MT, BQ / 16>(gk, fa, qt, lane);
      }
    } else {
#pragma unroll
      for (int mi = 0; mi < ATT_MT; ++mi) {
        const int key0 = k0 + row0 + mi * 16;
        auto vis = [&](int r, int i) { return att_visible(i0 + i, key0 + r); };
        unsigned short* w = (ATT_SCRATCH_OWN ? reinterpret_cast<unsigned short*>(ds + 2 * BQ)
                                             : reinterpret_cast<unsigned short*>(qo + (buf ^ 1) * PAIR)) +
                            warp * 16 * BQ;
        if (DV) att_exact<BQ>(gv[mi], s[mi], w, ot, lane, vis);
        if (DK) att_exact<BQ>(gk[mi], dp[mi], w, qt, lane, vis);
      }
      __syncthreads();
      if (t + 1 < ntiles) fetch(buf ^ 1, i0 + BQ);
    }
  }
  // No tile walked (no keys; or, for key and value gradients, no query that sees these keys):
  // the tiles' asynchronous copies may still be landing in the rows the stores stage through,
  // and no barrier has ordered them (compute-sanitizer racecheck found this).
  if (ntiles == 0) {
    att_cp_wait();
    __syncthreads();
  }
  // Each warp stages its own keys' rows of the k and v tiles (no other warp reads them).
  if (DK) att_store<ATT_MT>(dk, b * ATT_SK + k0, row0, ATT_SK - k0, gk, ATT_SCALE, ks + row0 * ATT_LDS, lane);
  if (DV) att_store<ATT_MT>(dv, b * ATT_SK + k0, row0, ATT_SK - k0, gv, 1.f, vs + row0 * ATT_LDS, lane);
}
