// Fused CPU kernels for the error-compensated 1-bit allreduce.
//
// Every kernel works on one wire "row": the payload one rank sends one peer for one chunk,
//     [status: f32][scales: f32 x nblocks][sign bits: u8 x chunk/8][zero pad to a multiple of 4]
// Bit k of byte b holds the sign of element 8*b + k (1 for >= 0, sign(0) = +1), the order
// _mm256_movemask_ps produces, so packing and unpacking are one instruction per 8 elements.
//
// The arithmetic is specified exactly so the pure-torch fallback (hvd_onebit/kernels/reference.py)
// and these kernels agree bit for bit: sums of squares accumulate in double, the scale is
// float(sqrt(sumsq / block)), the server average adds the ranks' decoded values in rank order in
// fp32 and divides by n. Nothing here may be contracted into FMAs (built with -ffp-contract=off).
//
// New rows are always written to a separate output buffer; y (and z) may be updated in place or
// not stored at all: a caller that must leave its error feedback untouched by a call that fails
// on any rank computes the rows first (y not stored) and, once every rank has succeeded, runs the
// same pass again with y updated in place. One y buffer instead of two, for one more read pass.
//
// The worker error is kept in factored form, e = y - s * sign(y), as the last call's y and the
// scales of the rows it sent rather than as e itself: the signs sent were y's own (y >= 0), so
// they are read back from y, not stored. e is only ever needed inside the next compression, which
// rebuilds it on the fly from the y it reads anyway. That makes worker compression a single pass
// over the data (read x and y_prev, write y and the bits), the same memory traffic as
// torch.add(x, e, out=y); an eagerly stored e would need a second pass after the scale is known.
// The arithmetic is unchanged: e is computed with the same fp32 subtraction.
#if defined(__x86_64__) || defined(_M_X64)
// Included first, before torch's headers include it: GCC 12's AVX-512 intrinsics start from an
// undefined vector and warn (maybe-uninitialized, GCC bug 105593) wherever they are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define HVD_ONEBIT_X86 1
#define HVD_AVX512 __attribute__((target("avx2,fma,avx512f,avx512dq,avx512bw,avx512vl")))
#endif

#include <torch/extension.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

struct Layout {
  int64_t n;          // ranks = chunks
  int64_t chunk;      // elements per chunk (multiple of 8)
  int64_t block;      // elements per scale (divides chunk, multiple of 8)
  int64_t row_bytes;  // bytes per wire row
  int64_t nblocks() const { return block > 0 ? chunk / block : 0; }
  int64_t header_bytes() const { return 4 * (1 + nblocks()); }
};

inline float* row_status(uint8_t* row) { return reinterpret_cast<float*>(row); }
inline float* row_scales(uint8_t* row) { return reinterpret_cast<float*>(row) + 1; }

// ---- group-of-8 primitives -------------------------------------------------------------------
// A "group" is 8 consecutive elements = one byte of sign bits. The scalar versions are the
// reference; the AVX2 versions compute exactly the same values.

inline double sumsq8_scalar(const float* y) {
  double acc = 0.0;
  for (int k = 0; k < 8; ++k) acc += static_cast<double>(y[k]) * static_cast<double>(y[k]);
  return acc;
}

inline void decode8_scalar(uint8_t bits, float s, float* out, int count) {
  for (int k = 0; k < count; ++k) out[k] = ((bits >> k) & 1) ? s : -s;
}


bool cpu_has_avx2() {
#if defined(HVD_ONEBIT_X86)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

// The 16-wide paths of the passes whose arithmetic would otherwise bound them (the worker
// compression, the decode with Adam's update): AVX-512 division and root are correctly rounded
// like the 8-wide ones, and on CPUs whose divider takes a 512-bit vector at the rate of a 256-bit
// one they halve its time per element. Same bits as the AVX2 and scalar code; set_avx512(false)
// falls back to AVX2 (the tests run both).
bool cpu_has_avx512() {
#if defined(HVD_ONEBIT_X86)
  static const bool has = cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

std::atomic<bool> avx512_allowed{true};

bool use_avx512() { return cpu_has_avx512() && avx512_allowed.load(std::memory_order_relaxed); }

// Allows or forbids the AVX-512 paths; returns whether they were allowed.
bool set_avx512(bool allowed) { return avx512_allowed.exchange(allowed); }

// ---- worker inputs -----------------------------------------------------------------------------
// The worker kernels read their input x through a source, so the optimizer's momentum update can
// be computed inside the compression pass instead of in a pass of its own:
//   PlainX:    x is a flat buffer.
//   MomentumX: x = beta1 * m + (1 - beta1) * g, with m the flat fused momentum and g the
//              parameters' own gradient tensors laid end to end (a missing gradient reads as 0).
//              Two fp32 products and one sum, never an FMA: the torch twin's
//              m * beta1 + g * (1 - beta1) gives the same bits.
// Reads are in increasing position (a few 8-element groups straddle two gradients), so
// MomentumX finds its segment with a cursor that only moves forward.

struct PlainX {
  const float* x;
  float at(int64_t p) { return x[p]; }
#if defined(HVD_ONEBIT_X86)
  __attribute__((target("avx2,fma"))) __m256 load8(int64_t p) { return _mm256_loadu_ps(x + p); }
  HVD_AVX512 __m512 load16(int64_t p) { return _mm512_loadu_ps(x + p); }
#endif
};

// Segments (parameters laid end to end, each with a [start, end) range in the flat buffer),
// looked up by position with a cursor: reads move forward, so a lookup is O(1) amortised.
template <class Segment>
struct SegmentCursor {
  const Segment* segs;
  int64_t nsegs;
  int64_t cur = 0;
  const Segment& at(int64_t p) {
    while (cur + 1 < nsegs && segs[cur].end <= p) ++cur;
    while (cur > 0 && segs[cur].start > p) --cur;  // a caller that steps back
    return segs[cur];
  }
};

struct GradSegment {
  const float* g;  // nullptr: no gradient, reads as zero
  int64_t start, end;  // [start, end) in the flat buffer
  // Preconditioning (v not nullptr): the source is clamp(x / denom, -bound, bound), denom
  // computed from the frozen variance v as the update computes it (+inf where v == 0, so held
  // elements give +-0). The clamp keeps the momentum where Adam's own could be (|m| <= B sqrt(v)):
  // a few elements whose gradient outgrew their frozen variance would otherwise set the chunk's
  // scale, and every element of the chunk would step by it.
  const float* v;
  float inv_root_bc2, eps, bound;  // inv_root_bc2: 1 / sqrt_bc2 (inverse_root_bc2)
};

// q clamped to [-bound, bound]; a NaN q stays NaN (both comparisons are false).
inline float clamp_to(float q, float bound) { return q < -bound ? -bound : (q > bound ? bound : q); }

// 1 / sqrt_bc2 in fp32 (sqrt_bc2 rounded to fp32 first, the division correctly rounded): the
// factor every denominator's root is multiplied by, computed once per parameter, so the passes
// over the elements take a root and a product where a second division stood.
inline float inverse_root_bc2(double sqrt_bc2) { return 1.0f / static_cast<float>(sqrt_bc2); }

// Adam's denominator from the frozen variance: sqrt(v) * inv_root_bc2 + eps, +inf where v == 0
// (an element held fixed). fp32, the root correctly rounded.
inline float frozen_denominator(float v, float inv_root_bc2, float eps) {
  return v == 0.0f ? std::numeric_limits<float>::infinity() : std::sqrt(v) * inv_root_bc2 + eps;
}

#if defined(HVD_ONEBIT_X86)
// frozen_denominator of 8 variances at once (in a register).
__attribute__((target("avx2,fma"))) inline __m256 denominator8(__m256 var, float inv_root_bc2,
                                                               float eps) {
  return _mm256_blendv_ps(
      _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(var), _mm256_set1_ps(inv_root_bc2)),
                    _mm256_set1_ps(eps)),
      _mm256_set1_ps(std::numeric_limits<float>::infinity()),
      _mm256_cmp_ps(var, _mm256_setzero_ps(), _CMP_EQ_OQ));
}

__attribute__((target("avx2,fma"))) inline __m256 frozen_denominator8(const float* v,
                                                                      float inv_root_bc2,
                                                                      float eps) {
  return denominator8(_mm256_loadu_ps(v), inv_root_bc2, eps);
}

// frozen_denominator of 16 variances at once (+inf where v == 0: held).
HVD_AVX512 inline __m512 frozen_denominator16(const float* v, float inv_root_bc2, float eps) {
  const __m512 var = _mm512_loadu_ps(v);
  return _mm512_mask_blend_ps(
      _mm512_cmp_ps_mask(var, _mm512_setzero_ps(), _CMP_EQ_OQ),
      _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(var), _mm512_set1_ps(inv_root_bc2)),
                    _mm512_set1_ps(eps)),
      _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

// Two groups of 8 as one 16-lane vector (lo in lanes 0-7).
HVD_AVX512 inline __m512 join16(__m256 lo, __m256 hi) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// The lanes of v that are +-inf.
HVD_AVX512 inline __mmask16 infinite16(__m512 v) { return _mm512_fpclass_ps_mask(v, 0x18); }

// clamp_to of 16 values, an infinite one kept as it is (a NaN stays NaN: max and min return
// their second operand then, as the 8-wide code relies on).
HVD_AVX512 inline __m512 clamp16_keep_inf(__m512 u, float bound) {
  const __m512 clamped =
      _mm512_min_ps(_mm512_set1_ps(bound), _mm512_max_ps(_mm512_set1_ps(-bound), u));
  return _mm512_mask_blend_ps(infinite16(u), clamped, u);
}
#endif

struct MomentumX {
  const float* m;
  SegmentCursor<GradSegment> segs;
  float beta1, one_minus_beta1;

  const GradSegment& seg_for(int64_t p) { return segs.at(p); }
  float at(int64_t p) {
    const GradSegment& s = seg_for(p);
    const float g = s.g ? s.g[p - s.start] : 0.0f;
    const float x = beta1 * m[p] + one_minus_beta1 * g;
    if (!s.v) return x;
    const float u = x / frozen_denominator(s.v[p - s.start], s.inv_root_bc2, s.eps);
    // an infinite u passes unclamped: the compression then reports the input as not finite
    return std::isinf(u) ? u : clamp_to(u, s.bound);
  }
#if defined(HVD_ONEBIT_X86)
  __attribute__((target("avx2,fma"))) __m256 load8(int64_t p) {
    const GradSegment& s = seg_for(p);
    __m256 g;
    if (p + 8 > s.end) {  // the group straddles two segments: element by element
      alignas(32) float t[8];
      for (int k = 0; k < 8; ++k) t[k] = at(p + k);
      seg_for(p);
      return _mm256_load_ps(t);
    }
    g = s.g ? _mm256_loadu_ps(s.g + (p - s.start)) : _mm256_setzero_ps();
    const __m256 x = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(beta1), _mm256_loadu_ps(m + p)),
                                   _mm256_mul_ps(_mm256_set1_ps(one_minus_beta1), g));
    if (!s.v) return x;
    const __m256 u = _mm256_div_ps(x, frozen_denominator8(s.v + (p - s.start), s.inv_root_bc2, s.eps));
    // clamp_to, 8 at a time (the second operand is returned for NaN: a NaN stays NaN), and an
    // infinite u kept as it is, as in at()
    const __m256 clamped =
        _mm256_min_ps(_mm256_set1_ps(s.bound), _mm256_max_ps(_mm256_set1_ps(-s.bound), u));
    const __m256 abs_u = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), u);
    return _mm256_blendv_ps(clamped, u,
                            _mm256_cmp_ps(abs_u, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                                          _CMP_EQ_OQ));
  }

  // load8 of p and p + 8 in one 16-lane vector: the same operations on twice the lanes.
  HVD_AVX512 __m512 load16(int64_t p) {
    const GradSegment& s = seg_for(p);
    if (p + 16 > s.end) {  // crosses a segment's end
      const __m256 lo = load8(p), hi = load8(p + 8);
      return join16(lo, hi);
    }
    const int64_t off = p - s.start;
    const __m512 g = s.g ? _mm512_loadu_ps(s.g + off) : _mm512_setzero_ps();
    const __m512 x = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(beta1), _mm512_loadu_ps(m + p)),
                                   _mm512_mul_ps(_mm512_set1_ps(one_minus_beta1), g));
    if (!s.v) return x;
    return clamp16_keep_inf(_mm512_div_ps(x, frozen_denominator16(s.v + off, s.inv_root_bc2, s.eps)),
                            s.bound);
  }
#endif
};

// x = (r_0 + r_1 + ... + r_{k-1}) / k, summed in row order in fp32, then one correctly rounded
// division: the hierarchical collective's node mean of a shard, computed inside the compression
// of that shard instead of in a pass of its own (the torch twin: copy, add_ in order, div_).
struct MeanX {
  std::vector<const float*> rows;
  float divisor;
  float at(int64_t p) {
    float acc = rows[0][p];
    for (size_t k = 1; k < rows.size(); ++k) acc = acc + rows[k][p];
    return acc / divisor;
  }
#if defined(HVD_ONEBIT_X86)
  __attribute__((target("avx2,fma"))) __m256 load8(int64_t p) {
    __m256 acc = _mm256_loadu_ps(rows[0] + p);
    for (size_t k = 1; k < rows.size(); ++k) acc = _mm256_add_ps(acc, _mm256_loadu_ps(rows[k] + p));
    return _mm256_div_ps(acc, _mm256_set1_ps(divisor));
  }
  HVD_AVX512 __m512 load16(int64_t p) {
    __m512 acc = _mm512_loadu_ps(rows[0] + p);
    for (size_t k = 1; k < rows.size(); ++k) acc = _mm512_add_ps(acc, _mm512_loadu_ps(rows[k] + p));
    return _mm512_div_ps(acc, _mm512_set1_ps(divisor));
  }
#endif
};

// ---- worker compression ------------------------------------------------------------------------
// For every chunk j and block b: e = y_prev - s_prev * sign(y_prev) (the factored worker error,
// s_prev = prev_scales[j * nblocks + b]),
// y = x + e, s = rms(y), signs of y into `send`, y into y_out. y_out may be y_prev itself (each
// element is read before it is written) or null (y not stored: the rows alone, for a caller that
// stores y only once the call has succeeded everywhere). x has `numel` valid elements;
// positions past it are padding (zeros). *finite becomes false when any block's sum of squares is
// not finite.

// base + p, or null where there is no output buffer.
inline float* offset_or_null(float* base, int64_t p) { return base ? base + p : nullptr; }

// e for one group, rebuilt from the previous call's y and scale: the sign sent was y's own.
inline void prev_error8_scalar(const float* y_prev, float prev_s, float* e) {
  for (int k = 0; k < 8; ++k) e[k] = y_prev[k] - (y_prev[k] >= 0.0f ? prev_s : -prev_s);
}

template <class XSource>
void worker_compress_scalar(XSource x, int64_t numel, const float* y_prev,
                            const float* prev_scales, float* y_out, uint8_t* send,
                            const Layout& L, bool* finite) {
  float e[8], scratch[8];
  const int64_t nb = L.nblocks();
  const int64_t hb = L.header_bytes();
  for (int64_t j = 0; j < L.n; ++j) {
    uint8_t* row = send + j * L.row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t base = j * L.chunk + b * L.block;
      const float prev_s = prev_scales[j * nb + b];
      double acc = 0.0;
      for (int64_t g = 0; g < L.block; g += 8) {
        const int64_t p = base + g;
        const int64_t byte = hb + (b * L.block + g) / 8;
        prev_error8_scalar(y_prev + p, prev_s, e);
        float* y = y_out ? y_out + p : scratch;
        // y = x + e, with x zero at and past numel (the padding)
        for (int k = 0; k < 8; ++k) y[k] = (p + k < numel ? x.at(p + k) : 0.0f) + e[k];
        acc += sumsq8_scalar(y);
        uint8_t bits = 0;
        for (int k = 0; k < 8; ++k) bits |= static_cast<uint8_t>(y[k] >= 0.0f) << k;
        row[byte] = bits;
      }
      if (!std::isfinite(acc)) *finite = false;
      row_scales(row)[b] = static_cast<float>(std::sqrt(acc / static_cast<double>(L.block)));
    }
  }
}

#if defined(HVD_ONEBIT_X86)
__attribute__((target("avx2,fma"))) inline __m256d sq_acc_pd(__m256 y, __m256d acc) {
  // Widen to double, square, accumulate. Two separate mul/add (no FMA) keep it exact w.r.t. the
  // scalar path's rounding of each square; only the summation order differs (sub-ulp in double).
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(y));
  const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1));
  acc = _mm256_add_pd(acc, _mm256_mul_pd(lo, lo));
  return _mm256_add_pd(acc, _mm256_mul_pd(hi, hi));
}

__attribute__((target("avx2,fma"))) inline double hsum_pd(__m256d v) {
  alignas(32) double t[4];
  _mm256_store_pd(t, v);
  return (t[0] + t[1]) + (t[2] + t[3]);
}

// Buffers of at least this many floats are written with non-temporal (streaming) stores: they
// are far larger than the caches and read again only in the next step, after the forward and
// backward pass have evicted them, so a normal store's read-for-ownership of every line is
// wasted memory traffic (4 of the ~16-20 bytes per element each fused pass moves).
constexpr int64_t kStreamMinFloats = int64_t(1) << 20;

__attribute__((target("avx2,fma"))) inline void store8(float* dst, __m256 v, bool stream) {
  if (stream && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    _mm256_stream_ps(dst, v);
  } else {
    _mm256_storeu_ps(dst, v);
  }
}

// Lane k set where bit k of `bits` is set.
__attribute__((target("avx2,fma"))) inline __m256 bitmask8_avx2(uint8_t bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i v = _mm256_and_si256(_mm256_set1_epi32(bits), sel);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, sel));
}

// One group: y = x + (y_prev - (+-prev_s), the sign y_prev's own); store y; accumulate y^2;
// return y's sign bits.
__attribute__((target("avx2,fma"))) inline uint8_t worker_group_avx2(
    __m256 x, const float* y_prev, __m256 prev_pos, __m256 prev_neg, float* y_out, __m256d* acc,
    bool stream) {
  const __m256 yp = _mm256_loadu_ps(y_prev);
  const __m256 e = _mm256_sub_ps(
      yp, _mm256_blendv_ps(prev_neg, prev_pos, _mm256_cmp_ps(yp, _mm256_setzero_ps(), _CMP_GE_OQ)));
  const __m256 y = _mm256_add_ps(x, e);
  if (y_out) store8(y_out, y, stream);
  *acc = sq_acc_pd(y, *acc);
  return static_cast<uint8_t>(
      _mm256_movemask_ps(_mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GE_OQ)));
}

template <class XSource>
__attribute__((target("avx2,fma"))) void worker_compress_avx2(
    XSource x, int64_t numel, const float* y_prev, const float* prev_scales, float* y_out,
    uint8_t* send, const Layout& L, bool* finite) {
  alignas(32) float tmp[8];
  const int64_t nb = L.nblocks();
  const int64_t hb = L.header_bytes();
  const int64_t full_end_all = (numel / 8) * 8;  // groups below this hold only real data
  // In place, y_prev's line was just read into the cache: a normal store is cheaper there.
  const bool stream = L.n * L.chunk >= kStreamMinFloats && y_out != y_prev;
  for (int64_t j = 0; j < L.n; ++j) {
    uint8_t* row = send + j * L.row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t base = j * L.chunk + b * L.block;
      const int64_t end = base + L.block;
      int64_t full_end = full_end_all < end ? full_end_all : end;
      if (full_end < base) full_end = base;
      const float prev_s = prev_scales[j * nb + b];
      const __m256 prev_pos = _mm256_set1_ps(prev_s), prev_neg = _mm256_set1_ps(-prev_s);
      uint8_t* bits = row + hb + b * L.block / 8;
      __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
      int64_t p = base;
      for (; p + 16 <= full_end; p += 16) {  // two accumulators hide the add latency
        *bits++ = worker_group_avx2(x.load8(p), y_prev + p, prev_pos,
                                    prev_neg, offset_or_null(y_out, p), &acc0, stream);
        *bits++ = worker_group_avx2(x.load8(p + 8), y_prev + p + 8,
                                    prev_pos, prev_neg, offset_or_null(y_out, p + 8), &acc1,
                                    stream);
      }
      for (; p < full_end; p += 8)
        *bits++ = worker_group_avx2(x.load8(p), y_prev + p, prev_pos,
                                    prev_neg, offset_or_null(y_out, p), &acc0, stream);
      for (; p < end; p += 8) {  // groups touching the padding: x is zero past numel
        for (int k = 0; k < 8; ++k) tmp[k] = p + k < numel ? x.at(p + k) : 0.0f;
        *bits++ = worker_group_avx2(_mm256_load_ps(tmp), y_prev + p, prev_pos,
                                    prev_neg, offset_or_null(y_out, p), &acc0, stream);
      }
      const double ss = hsum_pd(_mm256_add_pd(acc0, acc1));
      if (!std::isfinite(ss)) *finite = false;
      row_scales(row)[b] = static_cast<float>(std::sqrt(ss / static_cast<double>(L.block)));
    }
  }
  if (stream) _mm_sfence();  // streaming stores are weakly ordered: publish them
}

HVD_AVX512 inline void store16(float* dst, __m512 v, bool stream) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(dst);
  if (stream && (at & 63) == 0) {
    _mm512_stream_ps(dst, v);
  } else if (stream && (at & 31) == 0) {
    _mm256_stream_ps(dst, _mm512_castps512_ps256(v));
    _mm256_stream_ps(dst + 8, _mm512_extractf32x8_ps(v, 1));
  } else {
    _mm512_storeu_ps(dst, v);
  }
}

// 16 sign bits (two bytes) as a lane mask, bit k for lane k.
HVD_AVX512 inline __mmask16 load_bits16(const uint8_t* bits) {
  uint16_t b;
  std::memcpy(&b, bits, 2);
  return static_cast<__mmask16>(b);
}

// worker_compress_avx2 with its pairs of groups in one 16-lane vector. The squares add into the
// same two accumulators in the same order: lanes 0-3 of `acc` are acc0, which takes y[0:4]^2
// then y[4:8]^2 of each pair, and lanes 4-7 are acc1, which takes y[8:12]^2 then y[12:16]^2.
template <class XSource>
HVD_AVX512 void worker_compress_avx512(XSource x, int64_t numel, const float* y_prev,
                                       const float* prev_scales, float* y_out, uint8_t* send,
                                       const Layout& L, bool* finite) {
  alignas(32) float tmp[8];
  const int64_t nb = L.nblocks();
  const int64_t hb = L.header_bytes();
  const int64_t full_end_all = (numel / 8) * 8;
  const bool stream = L.n * L.chunk >= kStreamMinFloats && y_out != y_prev;
  // y[0:4], y[8:12] in the low half, y[4:8], y[12:16] in the high half
  const __m512i pairs = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
  for (int64_t j = 0; j < L.n; ++j) {
    uint8_t* row = send + j * L.row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t base = j * L.chunk + b * L.block;
      const int64_t end = base + L.block;
      int64_t full_end = full_end_all < end ? full_end_all : end;
      if (full_end < base) full_end = base;
      const float prev_s = prev_scales[j * nb + b];
      const __m512 pos16 = _mm512_set1_ps(prev_s), neg16 = _mm512_set1_ps(-prev_s);
      uint8_t* bits = row + hb + b * L.block / 8;
      __m512d acc = _mm512_setzero_pd();
      int64_t p = base;
      for (; p + 16 <= full_end; p += 16) {
        const __m512 y0 = _mm512_loadu_ps(y_prev + p);
        const __m512 e = _mm512_sub_ps(
            y0, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(y0, _mm512_setzero_ps(), _CMP_GE_OQ),
                                     neg16, pos16));
        const __m512 y = _mm512_add_ps(x.load16(p), e);
        if (y_out) store16(y_out + p, y, stream);
        const __m512 yp = _mm512_permutexvar_ps(pairs, y);
        const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(yp));
        const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(yp, 1));
        acc = _mm512_add_pd(acc, _mm512_mul_pd(lo, lo));
        acc = _mm512_add_pd(acc, _mm512_mul_pd(hi, hi));
        const uint16_t sign = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GE_OQ);
        std::memcpy(bits, &sign, 2);
        bits += 2;
      }
      __m256d acc0 = _mm512_castpd512_pd256(acc), acc1 = _mm512_extractf64x4_pd(acc, 1);
      const __m256 prev_pos = _mm256_set1_ps(prev_s), prev_neg = _mm256_set1_ps(-prev_s);
      for (; p < full_end; p += 8)
        *bits++ = worker_group_avx2(x.load8(p), y_prev + p, prev_pos,
                                    prev_neg, offset_or_null(y_out, p), &acc0, stream);
      for (; p < end; p += 8) {  // groups touching the padding: x is zero past numel
        for (int k = 0; k < 8; ++k) tmp[k] = p + k < numel ? x.at(p + k) : 0.0f;
        *bits++ = worker_group_avx2(_mm256_load_ps(tmp), y_prev + p, prev_pos,
                                    prev_neg, offset_or_null(y_out, p), &acc0, stream);
      }
      const double ss = hsum_pd(_mm256_add_pd(acc0, acc1));
      if (!std::isfinite(ss)) *finite = false;
      row_scales(row)[b] = static_cast<float>(std::sqrt(ss / static_cast<double>(L.block)));
    }
  }
  if (stream) _mm_sfence();
}
#endif

// ---- server step ------------------------------------------------------------------------------
// recv holds n rows (one from each rank) for this rank's chunk. z = mean_i(s_i * sign_i) + e_s,
// then z is compressed into out_row. Like the worker's, the server error is kept factored: the
// last call's z and the scales of the row it sent, e_s = z_prev - s_prev * sign(z_prev), rebuilt
// on the fly, so the server step is one pass (read the n rows and z_prev, write z and the bits).

void server_compress_scalar(const uint8_t* recv, const float* z_prev, const float* prev_scales,
                            float* z_out, uint8_t* out_row, const Layout& L, bool* finite) {
  const int64_t nb = L.nblocks();
  const int64_t hb = L.header_bytes();
  const float nf = static_cast<float>(L.n);
  float e[8], scratch[8];
  for (int64_t b = 0; b < nb; ++b) {
    const float prev_s = prev_scales[b];
    double ss = 0.0;
    for (int64_t g = 0; g < L.block; g += 8) {
      const int64_t p = b * L.block + g;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < L.n; ++i) {
        const uint8_t* row = recv + i * L.row_bytes;
        const float s = reinterpret_cast<const float*>(row)[1 + b];
        float v[8];
        decode8_scalar(row[hb + p / 8], s, v, 8);
        for (int k = 0; k < 8; ++k) acc[k] += v[k];
      }
      prev_error8_scalar(z_prev + p, prev_s, e);
      float* z = z_out ? z_out + p : scratch;
      for (int k = 0; k < 8; ++k) z[k] = acc[k] / nf + e[k];
      ss += sumsq8_scalar(z);
      uint8_t bits = 0;
      for (int k = 0; k < 8; ++k) bits |= static_cast<uint8_t>(z[k] >= 0.0f) << k;
      out_row[hb + p / 8] = bits;
    }
    if (!std::isfinite(ss)) *finite = false;
    row_scales(out_row)[b] = static_cast<float>(std::sqrt(ss / static_cast<double>(L.block)));
  }
}

#if defined(HVD_ONEBIT_X86)
__attribute__((target("avx2,fma"))) void server_compress_avx2(
    const uint8_t* recv, const float* z_prev, const float* prev_scales, float* z_out,
    uint8_t* out_row, const Layout& L, bool* finite) {
  const int64_t nb = L.nblocks();
  const int64_t hb = L.header_bytes();
  const __m256 nf = _mm256_set1_ps(static_cast<float>(L.n));
  const bool stream = L.chunk >= kStreamMinFloats && z_out != z_prev;  // see the worker's
  for (int64_t b = 0; b < nb; ++b) {
    const float prev_s = prev_scales[b];
    const __m256 prev_pos = _mm256_set1_ps(prev_s), prev_neg = _mm256_set1_ps(-prev_s);
    __m256d acc0 = _mm256_setzero_pd();
    for (int64_t g = 0; g < L.block; g += 8) {
      const int64_t p = b * L.block + g;
      // the rank-ordered fp32 sum of the decoded rows, divided by n: the server average
      __m256 sum = _mm256_setzero_ps();
      for (int64_t i = 0; i < L.n; ++i) {
        const uint8_t* row = recv + i * L.row_bytes;
        const float s = reinterpret_cast<const float*>(row)[1 + b];
        sum = _mm256_add_ps(sum, _mm256_blendv_ps(_mm256_set1_ps(-s), _mm256_set1_ps(s),
                                                  bitmask8_avx2(row[hb + p / 8])));
      }
      out_row[hb + p / 8] = worker_group_avx2(_mm256_div_ps(sum, nf), z_prev + p, prev_pos,
                                              prev_neg, offset_or_null(z_out, p), &acc0, stream);
    }
    const double ss = hsum_pd(acc0);
    if (!std::isfinite(ss)) *finite = false;
    row_scales(out_row)[b] = static_cast<float>(std::sqrt(ss / static_cast<double>(L.block)));
  }
  if (stream) _mm_sfence();
}
#endif

// ---- decode -------------------------------------------------------------------------------------
// out[p] = s * sign for every p < numel, reading n rows (one per chunk, in chunk order).

void decode_scalar(const uint8_t* rows, float* out, int64_t numel, const Layout& L) {
  const int64_t nb = L.nblocks();
  for (int64_t j = 0; j < L.n; ++j) {
    const uint8_t* row = rows + j * L.row_bytes;
    const float* scales = reinterpret_cast<const float*>(row) + 1;
    const uint8_t* bits = row + L.header_bytes();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t base = j * L.chunk + b * L.block;
      for (int64_t g = 0; g < L.block && base + g < numel; g += 8) {
        const int64_t cnt = numel - (base + g) < 8 ? numel - (base + g) : 8;
        decode8_scalar(bits[(b * L.block + g) / 8], scales[b], out + base + g,
                       static_cast<int>(cnt));
      }
    }
  }
}

// ---- decode fused with Adam's update ------------------------------------------------------------
// The optimizer's use of the averaged momentum d, fused into the decode pass so d is read once:
// m[p] = d, and for parameters that take the update here (the others are left to the caller),
//     denom = sqrt(v) * (1 / sqrt_bc2) + eps   (+inf where v == 0),
//     w = w * decay (when decay != 1), then w = w + clamp((step * d) / denom, -bound, bound),
// with v the frozen variance (exp_avg_sq), read here instead of a stored copy of the denominators
// (a parameter-sized buffer saved). fp32 throughout, in this order (sqrt and / correctly
// rounded, 1 / sqrt_bc2 once per parameter), so the torch twin and the Triton kernel give the
// same bits. An infinite denominator marks an element held fixed (its frozen variance is 0):
// the update adds +-0 and its momentum is stored as +0, so held elements cost one compare here
// instead of a scatter over their indices every step. The clamp is the step bound (hvd_onebit/step_bound.py): no element moves further
// than Adam itself could in one step; bound = +inf leaves the step as it was. It is written so a
// NaN step stays NaN, as torch.clamp keeps it. Segments are the parameters laid end to end in m.

struct UpdateSegment {
  float* w;             // nullptr: decode only
  const float* v;       // the frozen variance
  int64_t start, end;
  float step, decay, inv_root_bc2, eps;
  bool apply_decay;
  float bound;  // the largest |step * d / denom| taken; +inf: unbounded
  // d is the preconditioned momentum u = m / denom: m = u * denom is stored and the step is
  // clamp(step * u); a segment may then have a variance and no weight (decoded into m only).
  bool precond;
};


inline float denominator1(const UpdateSegment& s, float v) {
  return frozen_denominator(v, s.inv_root_bc2, s.eps);
}

// Element p of a segment with an update: d is the decoded momentum, written to m[p] (or +0).
inline void update1(const UpdateSegment& s, int64_t p, float d, float* m) {
  const float denom = denominator1(s, s.v[p - s.start]);
  if (s.precond) {
    const bool held = denom == std::numeric_limits<float>::infinity();
    m[p] = held ? 0.0f : d * denom;
    if (!s.w) return;
    float w = s.w[p - s.start];
    if (s.apply_decay) w = w * s.decay;
    s.w[p - s.start] = w + (held ? 0.0f : clamp_to(s.step * d, s.bound));
    return;
  }
  float w = s.w[p - s.start];
  if (s.apply_decay) w = w * s.decay;
  s.w[p - s.start] = w + clamp_to((s.step * d) / denom, s.bound);
  m[p] = denom == std::numeric_limits<float>::infinity() ? 0.0f : d;
}

#if defined(HVD_ONEBIT_X86)
// update1 for the 8 elements at p, all inside segment s (which has a weight); d: their momentum.
__attribute__((target("avx2,fma"))) inline void update8_avx2(const UpdateSegment& s, int64_t p,
                                                             __m256 d, float* m, bool stream) {
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  // denominator1, 8 at a time: the root is correctly rounded, as the scalar's
  const __m256 denom = frozen_denominator8(s.v + (p - s.start), s.inv_root_bc2, s.eps);
  if (s.precond) {
    const __m256 held = _mm256_cmp_ps(denom, inf, _CMP_EQ_OQ);
    store8(m + p, _mm256_andnot_ps(held, _mm256_mul_ps(d, denom)), stream);
    if (!s.w) return;
    float* wp = s.w + (p - s.start);
    __m256 w = _mm256_loadu_ps(wp);
    if (s.apply_decay) w = _mm256_mul_ps(w, _mm256_set1_ps(s.decay));
    __m256 q = _mm256_mul_ps(_mm256_set1_ps(s.step), d);
    q = _mm256_min_ps(_mm256_set1_ps(s.bound), _mm256_max_ps(_mm256_set1_ps(-s.bound), q));
    _mm256_storeu_ps(wp, _mm256_add_ps(w, _mm256_andnot_ps(held, q)));
    return;
  }
  // held elements (denominator +inf) store a +0 momentum
  store8(m + p, _mm256_andnot_ps(_mm256_cmp_ps(denom, inf, _CMP_EQ_OQ), d), stream);
  float* wp = s.w + (p - s.start);
  __m256 w = _mm256_loadu_ps(wp);
  if (s.apply_decay) w = _mm256_mul_ps(w, _mm256_set1_ps(s.decay));
  __m256 upd = _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(s.step), d), denom);
  // clamp1, 8 at a time: max_ps/min_ps return their second operand when either is NaN, so a NaN
  // step stays NaN as in the scalar code
  upd = _mm256_min_ps(_mm256_set1_ps(s.bound), _mm256_max_ps(_mm256_set1_ps(-s.bound), upd));
  _mm256_storeu_ps(wp, _mm256_add_ps(w, upd));
}

// update8_avx2 of the 16 elements at p, all inside segment s (which has a variance).
HVD_AVX512 inline void update16_avx512(const UpdateSegment& s, int64_t p, __m512 d, float* m,
                                       bool stream) {
  const __m512 denom = frozen_denominator16(s.v + (p - s.start), s.inv_root_bc2, s.eps);
  // not held: the denominator is not +inf (held lanes store +0 and add +0, as andnot gives)
  const __mmask16 live = _mm512_cmp_ps_mask(
      denom, _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_NEQ_UQ);
  if (s.precond) {
    store16(m + p, _mm512_maskz_mul_ps(live, d, denom), stream);
    if (!s.w) return;
    float* wp = s.w + (p - s.start);
    __m512 w = _mm512_loadu_ps(wp);
    if (s.apply_decay) w = _mm512_mul_ps(w, _mm512_set1_ps(s.decay));
    __m512 q = _mm512_mul_ps(_mm512_set1_ps(s.step), d);
    q = _mm512_min_ps(_mm512_set1_ps(s.bound), _mm512_max_ps(_mm512_set1_ps(-s.bound), q));
    _mm512_storeu_ps(wp, _mm512_add_ps(w, _mm512_maskz_mov_ps(live, q)));
    return;
  }
  store16(m + p, _mm512_maskz_mov_ps(live, d), stream);
  float* wp = s.w + (p - s.start);
  __m512 w = _mm512_loadu_ps(wp);
  if (s.apply_decay) w = _mm512_mul_ps(w, _mm512_set1_ps(s.decay));
  __m512 upd = _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(s.step), d), denom);
  upd = _mm512_min_ps(_mm512_set1_ps(s.bound), _mm512_max_ps(_mm512_set1_ps(-s.bound), upd));
  _mm512_storeu_ps(wp, _mm512_add_ps(w, upd));
}
#endif

void decode_update_scalar(const uint8_t* rows, float* m, int64_t numel, const Layout& L,
                          SegmentCursor<UpdateSegment> segs) {
  decode_scalar(rows, m, numel, L);
  for (int64_t p = 0; p < numel; ++p) {
    const UpdateSegment& s = segs.at(p);
    if (s.v) update1(s, p, m[p], m);
  }
}

#if defined(HVD_ONEBIT_X86)
__attribute__((target("avx2,fma"))) void decode_update_avx2(const uint8_t* rows, float* m,
                                                            int64_t numel, const Layout& L,
                                                            SegmentCursor<UpdateSegment> segs) {
  const int64_t nb = L.nblocks();
  const bool stream = numel >= kStreamMinFloats;
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int64_t j = 0; j < L.n; ++j) {
    const uint8_t* row = rows + j * L.row_bytes;
    const float* scales = reinterpret_cast<const float*>(row) + 1;
    const uint8_t* bits = row + L.header_bytes();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t base = j * L.chunk + b * L.block;
      int64_t stop = base + L.block;
      if (stop > numel) stop = numel;
      const __m256 pos_s = _mm256_set1_ps(scales[b]), neg_s = _mm256_set1_ps(-scales[b]);
      const uint8_t* bp = bits + b * L.block / 8;
      int64_t p = base;
      while (p < stop) {
        const UpdateSegment& s = segs.at(p);
        // Full groups inside this segment: vector decode and update.
        int64_t seg_stop = s.end < stop ? s.end : stop;
        if (s.v) {
          for (; p + 8 <= seg_stop && (p - base) % 8 == 0; p += 8) {
            const __m256i v = _mm256_and_si256(_mm256_set1_epi32(bp[(p - base) / 8]), sel);
            update8_avx2(s, p,
                         _mm256_blendv_ps(neg_s, pos_s,
                                          _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, sel))),
                         m, stream);
          }
        } else {
          for (; p + 8 <= seg_stop && (p - base) % 8 == 0; p += 8) {
            const __m256i v = _mm256_and_si256(_mm256_set1_epi32(bp[(p - base) / 8]), sel);
            store8(m + p, _mm256_blendv_ps(
                              neg_s, pos_s, _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, sel))),
                   stream);
          }
        }
        // Elements one at a time up to the segment's end or the next whole group.
        for (; p < seg_stop && (p + 8 > seg_stop || (p - base) % 8 != 0); ++p) {
          const int64_t k = p - base;
          const float d = ((bp[k / 8] >> (k % 8)) & 1) ? scales[b] : -scales[b];
          if (s.v) {
            update1(s, p, d, m);
          } else {
            m[p] = d;
          }
        }
      }
    }
  }
  if (stream) _mm_sfence();
}
#endif

#if defined(HVD_ONEBIT_X86)
// decode_update_avx2 with 16 elements (two sign bytes) at a time where they lie in one segment.
HVD_AVX512 void decode_update_avx512(const uint8_t* rows, float* m, int64_t numel,
                                     const Layout& L, SegmentCursor<UpdateSegment> segs) {
  const int64_t nb = L.nblocks();
  const bool stream = numel >= kStreamMinFloats;
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int64_t j = 0; j < L.n; ++j) {
    const uint8_t* row = rows + j * L.row_bytes;
    const float* scales = reinterpret_cast<const float*>(row) + 1;
    const uint8_t* bits = row + L.header_bytes();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t base = j * L.chunk + b * L.block;
      int64_t stop = base + L.block;
      if (stop > numel) stop = numel;
      const __m256 pos_s = _mm256_set1_ps(scales[b]), neg_s = _mm256_set1_ps(-scales[b]);
      const __m512 pos16 = _mm512_set1_ps(scales[b]), neg16 = _mm512_set1_ps(-scales[b]);
      const uint8_t* bp = bits + b * L.block / 8;
      int64_t p = base;
      while (p < stop) {
        const UpdateSegment& s = segs.at(p);
        int64_t seg_stop = s.end < stop ? s.end : stop;
        if ((p - base) % 8 == 0) {
          if (s.v) {
            for (; p + 16 <= seg_stop; p += 16)
              update16_avx512(s, p,
                              _mm512_mask_blend_ps(load_bits16(bp + (p - base) / 8), neg16, pos16),
                              m, stream);
          } else {
            for (; p + 16 <= seg_stop; p += 16)
              store16(m + p,
                      _mm512_mask_blend_ps(load_bits16(bp + (p - base) / 8), neg16, pos16),
                      stream);
          }
        }
        // A last whole group of 8, as decode_update_avx2 does it.
        if (p + 8 <= seg_stop && (p - base) % 8 == 0) {
          const __m256i v = _mm256_and_si256(_mm256_set1_epi32(bp[(p - base) / 8]), sel);
          const __m256 d =
              _mm256_blendv_ps(neg_s, pos_s, _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, sel)));
          if (s.v) {
            update8_avx2(s, p, d, m, stream);
          } else {
            store8(m + p, d, stream);
          }
          p += 8;
        }
        // Elements one at a time up to the segment's end or the next whole group.
        for (; p < seg_stop && (p + 8 > seg_stop || (p - base) % 8 != 0); ++p) {
          const int64_t k = p - base;
          const float d = ((bp[k / 8] >> (k % 8)) & 1) ? scales[b] : -scales[b];
          if (s.v) {
            update1(s, p, d, m);
          } else {
            m[p] = d;
          }
        }
      }
    }
  }
  if (stream) _mm_sfence();
}
#endif

// ---- Adam's update from a momentum already decoded ------------------------------------------------
// The same update as decode_update, for a collective whose averaged momentum arrives decoded (the
// hierarchical collective gathers float32 shards): m[p] = src[p] (+0 where held) and the weight
// update, in one pass over src, m, w and v. src may be m.

void update_scalar(const float* src, float* m, const std::vector<UpdateSegment>& segs) {
  for (const UpdateSegment& s : segs) {
    for (int64_t p = s.start; p < s.end; ++p) {
      if (s.v) {
        update1(s, p, src[p], m);
      } else {
        m[p] = src[p];
      }
    }
  }
}

#if defined(HVD_ONEBIT_X86)
__attribute__((target("avx2,fma"))) void update_avx2(const float* src, float* m, int64_t numel,
                                                     const std::vector<UpdateSegment>& segs) {
  const bool stream = numel >= kStreamMinFloats && src != m;
  for (const UpdateSegment& s : segs) {
    int64_t p = s.start;
    if (s.v) {
      for (; p + 8 <= s.end; p += 8) update8_avx2(s, p, _mm256_loadu_ps(src + p), m, stream);
      for (; p < s.end; ++p) update1(s, p, src[p], m);
    } else {
      for (; p + 8 <= s.end; p += 8) store8(m + p, _mm256_loadu_ps(src + p), stream);
      for (; p < s.end; ++p) m[p] = src[p];
    }
  }
  if (stream) _mm_sfence();
}

HVD_AVX512 void update_avx512(const float* src, float* m, int64_t numel,
                              const std::vector<UpdateSegment>& segs) {
  const bool stream = numel >= kStreamMinFloats && src != m;
  for (const UpdateSegment& s : segs) {
    int64_t p = s.start;
    if (s.v) {
      for (; p + 16 <= s.end; p += 16) update16_avx512(s, p, _mm512_loadu_ps(src + p), m, stream);
      for (; p + 8 <= s.end; p += 8) update8_avx2(s, p, _mm256_loadu_ps(src + p), m, stream);
      for (; p < s.end; ++p) update1(s, p, src[p], m);
    } else {
      for (; p + 16 <= s.end; p += 16) store16(m + p, _mm512_loadu_ps(src + p), stream);
      for (; p < s.end; ++p) m[p] = src[p];
    }
  }
  if (stream) _mm_sfence();
}
#endif

// ---- argument checks shared by the bindings ---------------------------------------------------

Layout make_layout(int64_t n, int64_t chunk, int64_t block, int64_t row_bytes) {
  TORCH_CHECK(n >= 1, "n must be >= 1, got ", n);
  TORCH_CHECK(chunk >= 0 && chunk % 8 == 0, "chunk must be a multiple of 8, got ", chunk);
  TORCH_CHECK(block > 0 && block % 8 == 0 && chunk % block == 0,
              "block must be a positive multiple of 8 dividing chunk, got ", block);
  Layout L{n, chunk, block, row_bytes};
  TORCH_CHECK(row_bytes >= L.header_bytes() + chunk / 8, "row_bytes too small: ", row_bytes);
  return L;
}

void check_cpu(const torch::Tensor& t, torch::ScalarType dtype, const char* name, int64_t min_numel) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() >= min_numel, name, " has ", t.numel(), " elements, needs ", min_numel);
}

// The data of an optional float32 output of `numel` elements: null when absent; it may be `prev`
// itself (updated in place: every element is read before it is written) but not overlap it
// otherwise.
float* output_or_null(const c10::optional<torch::Tensor>& out, const torch::Tensor& prev,
                      int64_t numel, const char* name, const char* prev_name) {
  if (!out.has_value() || !out->defined()) return nullptr;
  check_cpu(*out, torch::kFloat32, name, numel);
  const float* o = out->data_ptr<float>();
  const float* p = prev.data_ptr<float>();
  TORCH_CHECK(o == p || o + numel <= p || p + numel <= o, name, " must be ", prev_name,
              " itself or not overlap it");
  return out->data_ptr<float>();
}

// ---- bindings ----------------------------------------------------------------------------------

template <class XSource>
bool run_worker_compress(XSource x, int64_t numel, const torch::Tensor& y_prev,
                         const torch::Tensor& prev_scales,
                         const c10::optional<torch::Tensor>& y_out,
                         torch::Tensor send, int64_t n, int64_t chunk, int64_t block,
                         int64_t row_bytes, bool allow_simd);

bool worker_compress(const torch::Tensor& x, const torch::Tensor& y_prev,
                     const torch::Tensor& prev_scales, const c10::optional<torch::Tensor>& y_out,
                     torch::Tensor send,
                     int64_t n, int64_t chunk, int64_t block, int64_t row_bytes, bool allow_simd) {
  check_cpu(x, torch::kFloat32, "x", 0);
  TORCH_CHECK(x.numel() <= n * chunk, "x has more elements than the layout holds");
  const float* xp = x.numel() ? x.data_ptr<float>() : nullptr;
  return run_worker_compress(PlainX{xp}, x.numel(), y_prev, prev_scales, y_out, send, n, chunk,
                             block, row_bytes, allow_simd);
}

bool worker_compress_mean(const std::vector<torch::Tensor>& rows, const torch::Tensor& y_prev,
                          const torch::Tensor& prev_scales,
                          const c10::optional<torch::Tensor>& y_out, torch::Tensor send,
                          int64_t n, int64_t chunk, int64_t block, int64_t row_bytes,
                          bool allow_simd) {
  TORCH_CHECK(!rows.empty(), "at least one row to average");
  const int64_t numel = rows[0].numel();
  TORCH_CHECK(numel <= n * chunk, "rows have more elements than the layout holds");
  MeanX x{{}, static_cast<float>(rows.size())};
  for (const torch::Tensor& r : rows) {
    check_cpu(r, torch::kFloat32, "row", numel);
    TORCH_CHECK(r.numel() == numel, "every row must have ", numel, " elements, got ", r.numel());
    x.rows.push_back(numel ? r.data_ptr<float>() : nullptr);
  }
  return run_worker_compress(x, numel, y_prev, prev_scales, y_out, send, n, chunk, block,
                             row_bytes, allow_simd);
}

// The gradient segments of a momentum update (checked against m's size); never empty.
// With variances (one per gradient, each with its sqrt_bc2 and eps), the source is preconditioned.
std::vector<GradSegment> grad_segments(const torch::Tensor& m,
                                       const std::vector<c10::optional<torch::Tensor>>& grads,
                                       const std::vector<int64_t>& sizes,
                                       const std::vector<c10::optional<torch::Tensor>>& variances,
                                       const std::vector<double>& sqrt_bc2s,
                                       const std::vector<double>& epss,
                                       const std::vector<double>& bounds) {
  check_cpu(m, torch::kFloat32, "momentum", 0);
  TORCH_CHECK(grads.size() == sizes.size(), "one size per gradient");
  const bool precondition = !variances.empty();
  TORCH_CHECK(!precondition || (variances.size() == sizes.size() &&
                                sqrt_bc2s.size() == sizes.size() && epss.size() == sizes.size() &&
                                bounds.size() == sizes.size()),
              "preconditioning needs one variance, sqrt_bc2, eps and bound per gradient");
  std::vector<GradSegment> segs;
  int64_t start = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const float* g = nullptr;
    if (grads[i].has_value() && grads[i]->defined()) {
      check_cpu(*grads[i], torch::kFloat32, "gradient", sizes[i]);
      TORCH_CHECK(grads[i]->numel() == sizes[i], "gradient ", i, " has ", grads[i]->numel(),
                  " elements, expected ", sizes[i]);
      g = grads[i]->data_ptr<float>();
    }
    GradSegment seg{g, start, start + sizes[i], nullptr, 1.0f, 0.0f,
                    std::numeric_limits<float>::infinity()};
    if (precondition) {
      TORCH_CHECK(variances[i].has_value() && variances[i]->defined(), "gradient ", i,
                  " has no variance to precondition with");
      check_cpu(*variances[i], torch::kFloat32, "variance", sizes[i]);
      TORCH_CHECK(variances[i]->numel() == sizes[i], "variance ", i, " has ",
                  variances[i]->numel(), " elements, expected ", sizes[i]);
      seg.v = variances[i]->data_ptr<float>();
      seg.inv_root_bc2 = inverse_root_bc2(sqrt_bc2s[i]);
      seg.eps = static_cast<float>(epss[i]);
      seg.bound = static_cast<float>(bounds[i]);
      TORCH_CHECK(!(seg.bound < 0.0f), "bound ", i, " must be >= 0, got ", bounds[i]);
    }
    segs.push_back(seg);
    start += sizes[i];
  }
  TORCH_CHECK(start == m.numel(), "gradients hold ", start, " elements, momentum ", m.numel());
  if (segs.empty())
    segs.push_back(GradSegment{nullptr, 0, 0, nullptr, 1.0f, 0.0f,
                               std::numeric_limits<float>::infinity()});
  return segs;
}

// Both coefficients rounded to fp32 from double, as torch rounds a Python scalar.
MomentumX momentum_source(const torch::Tensor& m, const std::vector<GradSegment>& segs,
                          double beta1) {
  return MomentumX{m.numel() ? m.data_ptr<float>() : nullptr,
                   SegmentCursor<GradSegment>{segs.data(), static_cast<int64_t>(segs.size())},
                   static_cast<float>(beta1), static_cast<float>(1.0 - beta1)};
}

bool worker_compress_momentum(const torch::Tensor& m, const std::vector<c10::optional<torch::Tensor>>& grads,
                              const std::vector<int64_t>& sizes, double beta1,
                              const std::vector<c10::optional<torch::Tensor>>& variances,
                              const std::vector<double>& sqrt_bc2s,
                              const std::vector<double>& epss,
                              const std::vector<double>& bounds,
                              const torch::Tensor& y_prev, const torch::Tensor& prev_scales,
                              const c10::optional<torch::Tensor>& y_out, torch::Tensor send,
                              int64_t n, int64_t chunk,
                              int64_t block, int64_t row_bytes, bool allow_simd) {
  TORCH_CHECK(m.numel() <= n * chunk, "momentum has more elements than the layout holds");
  const std::vector<GradSegment> segs =
      grad_segments(m, grads, sizes, variances, sqrt_bc2s, epss, bounds);
  return run_worker_compress(momentum_source(m, segs, beta1), m.numel(), y_prev, prev_scales,
                             y_out, send, n, chunk, block, row_bytes, allow_simd);
}

#if defined(HVD_ONEBIT_X86)
// Whole groups of 8 from the start; returns where the scalar tail begins. (A function of its
// own: __m256 values may only cross calls between AVX2-targeted functions.)
__attribute__((target("avx2,fma"))) int64_t momentum_update_avx2(MomentumX x, int64_t numel,
                                                                   float* o) {
  const bool stream = numel >= kStreamMinFloats;
  int64_t p = 0;
  for (; p + 8 <= numel; p += 8) store8(o + p, x.load8(p), stream);
  if (stream) _mm_sfence();
  return p;
}

HVD_AVX512 int64_t momentum_update_avx512(MomentumX x, int64_t numel, float* o) {
  const bool stream = numel >= kStreamMinFloats;
  int64_t p = 0;
  for (; p + 16 <= numel; p += 16) store16(o + p, x.load16(p), stream);
  for (; p + 8 <= numel; p += 8) store8(o + p, x.load8(p), stream);
  if (stream) _mm_sfence();
  return p;
}
#endif

// out = beta1 * m + (1 - beta1) * g: the worker compression's momentum source written out, for a
// collective that sends the momentum in full precision first (the hierarchical one's node stage).
void momentum_update(const torch::Tensor& m, const std::vector<c10::optional<torch::Tensor>>& grads,
                     const std::vector<int64_t>& sizes, double beta1,
                     const std::vector<c10::optional<torch::Tensor>>& variances,
                     const std::vector<double>& sqrt_bc2s, const std::vector<double>& epss,
                     const std::vector<double>& bounds, torch::Tensor out, bool allow_simd) {
  const std::vector<GradSegment> segs =
      grad_segments(m, grads, sizes, variances, sqrt_bc2s, epss, bounds);
  check_cpu(out, torch::kFloat32, "out", m.numel());
  TORCH_CHECK(out.data_ptr() != m.data_ptr() || m.numel() == 0, "out must not be the momentum");
  MomentumX x = momentum_source(m, segs, beta1);
  const int64_t numel = m.numel();
  float* o = numel ? out.data_ptr<float>() : nullptr;
  pybind11::gil_scoped_release no_gil;
  int64_t p = 0;
#if defined(HVD_ONEBIT_X86)
  if (allow_simd && use_avx512()) {
    p = momentum_update_avx512(x, numel, o);
  } else if (allow_simd && cpu_has_avx2()) {
    p = momentum_update_avx2(x, numel, o);
  }
#endif
  for (; p < numel; ++p) o[p] = x.at(p);
}

template <class XSource>
bool run_worker_compress(XSource x, int64_t numel, const torch::Tensor& y_prev,
                         const torch::Tensor& prev_scales,
                         const c10::optional<torch::Tensor>& y_out,
                         torch::Tensor send, int64_t n, int64_t chunk, int64_t block,
                         int64_t row_bytes, bool allow_simd) {
  const Layout L = make_layout(n, chunk, block, row_bytes);
  check_cpu(y_prev, torch::kFloat32, "y_prev", n * chunk);
  check_cpu(prev_scales, torch::kFloat32, "prev_scales", n * L.nblocks());
  check_cpu(send, torch::kUInt8, "send", n * row_bytes);
  float* y_out_p = output_or_null(y_out, y_prev, n * chunk, "y_out", "y_prev");
  bool finite = true;
  {
    pybind11::gil_scoped_release no_gil;
#if defined(HVD_ONEBIT_X86)
    if (allow_simd && use_avx512())
      worker_compress_avx512(x, numel, y_prev.data_ptr<float>(), prev_scales.data_ptr<float>(),
                             y_out_p, send.data_ptr<uint8_t>(), L, &finite);
    else if (allow_simd && cpu_has_avx2())
      worker_compress_avx2(x, numel, y_prev.data_ptr<float>(), prev_scales.data_ptr<float>(),
                           y_out_p, send.data_ptr<uint8_t>(), L, &finite);
    else
#endif
      worker_compress_scalar(x, numel, y_prev.data_ptr<float>(),
                             prev_scales.data_ptr<float>(), y_out_p,
                             send.data_ptr<uint8_t>(), L, &finite);
    const float status = finite ? 0.0f : 1.0f;
    for (int64_t j = 0; j < n; ++j) {
      uint8_t* row = send.data_ptr<uint8_t>() + j * row_bytes;
      *row_status(row) = status;
      // Zero the alignment pad so the wire carries no uninitialised bytes.
      const int64_t used = L.header_bytes() + chunk / 8;
      std::memset(row + used, 0, row_bytes - used);
    }
  }
  return finite;
}

bool server_compress(const torch::Tensor& recv, const torch::Tensor& z_prev,
                     const torch::Tensor& prev_scales, const c10::optional<torch::Tensor>& z_out,
                     torch::Tensor out_row,
                     int64_t n, int64_t chunk, int64_t block, int64_t row_bytes, bool allow_simd) {
  const Layout L = make_layout(n, chunk, block, row_bytes);
  check_cpu(recv, torch::kUInt8, "recv", n * row_bytes);
  check_cpu(z_prev, torch::kFloat32, "z_prev", chunk);
  check_cpu(prev_scales, torch::kFloat32, "prev_scales", L.nblocks());
  check_cpu(out_row, torch::kUInt8, "out_row", row_bytes);
  float* z_out_p = output_or_null(z_out, z_prev, chunk, "z_out", "z_prev");
  bool finite = true;
  {
    pybind11::gil_scoped_release no_gil;
#if defined(HVD_ONEBIT_X86)
    if (allow_simd && cpu_has_avx2())
      server_compress_avx2(recv.data_ptr<uint8_t>(), z_prev.data_ptr<float>(),
                           prev_scales.data_ptr<float>(), z_out_p,
                           out_row.data_ptr<uint8_t>(), L, &finite);
    else
#endif
      server_compress_scalar(recv.data_ptr<uint8_t>(), z_prev.data_ptr<float>(),
                             prev_scales.data_ptr<float>(), z_out_p,
                             out_row.data_ptr<uint8_t>(), L, &finite);
    uint8_t* row = out_row.data_ptr<uint8_t>();
    *row_status(row) = finite ? 0.0f : 1.0f;
    const int64_t used = L.header_bytes() + chunk / 8;
    std::memset(row + used, 0, row_bytes - used);
  }
  return finite;
}

void decode(const torch::Tensor& rows, torch::Tensor out, int64_t n, int64_t chunk, int64_t block,
            int64_t row_bytes, bool allow_simd) {
  const Layout L = make_layout(n, chunk, block, row_bytes);
  check_cpu(rows, torch::kUInt8, "rows", n * row_bytes);
  check_cpu(out, torch::kFloat32, "out", 0);
  TORCH_CHECK(out.numel() <= n * chunk, "out has more elements than the layout holds");
  if (out.numel() == 0) return;
  pybind11::gil_scoped_release no_gil;
#if defined(HVD_ONEBIT_X86)
  if (allow_simd && cpu_has_avx2()) {
    // decode alone is decode_update over one segment that takes no update
    const UpdateSegment none{nullptr, nullptr, 0, out.numel(), 0.0f, 1.0f, 1.0f, 0.0f, false,
                             std::numeric_limits<float>::infinity(), false};
    const SegmentCursor<UpdateSegment> cursor{&none, 1};
    if (use_avx512()) {
      decode_update_avx512(rows.data_ptr<uint8_t>(), out.data_ptr<float>(), out.numel(), L,
                           cursor);
    } else {
      decode_update_avx2(rows.data_ptr<uint8_t>(), out.data_ptr<float>(), out.numel(), L,
                         cursor);
    }
    return;
  }
#endif
  decode_scalar(rows.data_ptr<uint8_t>(), out.data_ptr<float>(), out.numel(), L);
}

// The UpdateSegments of the parameters laid end to end in m (checked against m's size).
std::vector<UpdateSegment> update_segments(
    const torch::Tensor& m, const std::vector<c10::optional<torch::Tensor>>& weights,
    const std::vector<c10::optional<torch::Tensor>>& variances, const std::vector<int64_t>& sizes,
    const std::vector<double>& steps, const std::vector<double>& decays,
    const std::vector<double>& sqrt_bc2s, const std::vector<double>& epss,
    const std::vector<double>& bounds, bool precond) {
  const size_t k = sizes.size();
  TORCH_CHECK(weights.size() == k && variances.size() == k && steps.size() == k &&
                  decays.size() == k && sqrt_bc2s.size() == k && epss.size() == k &&
                  bounds.size() == k,
              "one weight, variance, step, decay, sqrt_bc2, eps and bound per size");
  std::vector<UpdateSegment> segs;
  int64_t start = 0;
  for (size_t i = 0; i < k; ++i) {
    // Each scalar rounded to fp32 from double, as torch rounds a Python scalar.
    UpdateSegment seg{nullptr, nullptr, start, start + sizes[i], static_cast<float>(steps[i]),
                      static_cast<float>(decays[i]), inverse_root_bc2(sqrt_bc2s[i]),
                      static_cast<float>(epss[i]), decays[i] != 1.0,
                      static_cast<float>(bounds[i]), precond};
    TORCH_CHECK(!(seg.bound < 0.0f), "bound ", i, " must be >= 0, got ", bounds[i]);
    const bool has_w = weights[i].has_value() && weights[i]->defined();
    const bool has_v = variances[i].has_value() && variances[i]->defined();
    TORCH_CHECK(!has_w || has_v, "weight ", i, " has no variance");
    TORCH_CHECK(precond || has_w || !has_v, "variance ", i,
                " without a weight is only read when preconditioned");
    if (has_v) {
      check_cpu(*variances[i], torch::kFloat32, "variance", sizes[i]);
      TORCH_CHECK(variances[i]->numel() == sizes[i], "variance ", i, " must have ", sizes[i],
                  " elements");
      seg.v = variances[i]->data_ptr<float>();
    }
    if (has_w) {
      check_cpu(*weights[i], torch::kFloat32, "weight", sizes[i]);
      TORCH_CHECK(weights[i]->numel() == sizes[i], "weight ", i, " must have ", sizes[i],
                  " elements");
      seg.w = weights[i]->data_ptr<float>();
    }
    segs.push_back(seg);
    start += sizes[i];
  }
  TORCH_CHECK(start == m.numel(), "weights hold ", start, " elements, momentum ", m.numel());
  return segs;
}

void decode_update(const torch::Tensor& rows, torch::Tensor m,
                   const std::vector<c10::optional<torch::Tensor>>& weights,
                   const std::vector<c10::optional<torch::Tensor>>& variances,
                   const std::vector<int64_t>& sizes, const std::vector<double>& steps,
                   const std::vector<double>& decays, const std::vector<double>& sqrt_bc2s,
                   const std::vector<double>& epss, const std::vector<double>& bounds,
                   bool precond, int64_t n, int64_t chunk, int64_t block,
                   int64_t row_bytes, bool allow_simd) {
  const Layout L = make_layout(n, chunk, block, row_bytes);
  check_cpu(rows, torch::kUInt8, "rows", n * row_bytes);
  check_cpu(m, torch::kFloat32, "momentum", 0);
  TORCH_CHECK(m.numel() <= n * chunk, "momentum has more elements than the layout holds");
  const std::vector<UpdateSegment> segs =
      update_segments(m, weights, variances, sizes, steps, decays, sqrt_bc2s, epss, bounds,
                      precond);
  if (m.numel() == 0) return;
  SegmentCursor<UpdateSegment> cursor{segs.data(), static_cast<int64_t>(segs.size())};
  pybind11::gil_scoped_release no_gil;
#if defined(HVD_ONEBIT_X86)
  if (allow_simd && use_avx512()) {
    decode_update_avx512(rows.data_ptr<uint8_t>(), m.data_ptr<float>(), m.numel(), L, cursor);
    return;
  }
  if (allow_simd && cpu_has_avx2()) {
    decode_update_avx2(rows.data_ptr<uint8_t>(), m.data_ptr<float>(), m.numel(), L, cursor);
    return;
  }
#endif
  decode_update_scalar(rows.data_ptr<uint8_t>(), m.data_ptr<float>(), m.numel(), L, cursor);
}

void update(const torch::Tensor& src, torch::Tensor m,
            const std::vector<c10::optional<torch::Tensor>>& weights,
            const std::vector<c10::optional<torch::Tensor>>& variances,
            const std::vector<int64_t>& sizes, const std::vector<double>& steps,
            const std::vector<double>& decays, const std::vector<double>& sqrt_bc2s,
            const std::vector<double>& epss, const std::vector<double>& bounds, bool precond,
            bool allow_simd) {
  check_cpu(m, torch::kFloat32, "momentum", 0);
  check_cpu(src, torch::kFloat32, "src", m.numel());
  TORCH_CHECK(src.numel() == m.numel(), "src has ", src.numel(), " elements, momentum ",
              m.numel());
  const std::vector<UpdateSegment> segs =
      update_segments(m, weights, variances, sizes, steps, decays, sqrt_bc2s, epss, bounds,
                      precond);
  if (m.numel() == 0) return;
  pybind11::gil_scoped_release no_gil;
#if defined(HVD_ONEBIT_X86)
  if (allow_simd && use_avx512()) {
    update_avx512(src.data_ptr<float>(), m.data_ptr<float>(), m.numel(), segs);
    return;
  }
  if (allow_simd && cpu_has_avx2()) {
    update_avx2(src.data_ptr<float>(), m.data_ptr<float>(), m.numel(), segs);
    return;
  }
#endif
  update_scalar(src.data_ptr<float>(), m.data_ptr<float>(), segs);
}

// ---- denominators (a variance refresh) -------------------------------------------------------
// out = frozen_denominator(v) (divide false), or out = out / frozen_denominator(v) with every
// non-finite quotient set to 0 (divide true): a refresh's factor from the old denominators (in
// out) to the new ones, where an infinite one on either side (a held element) gives 0.

inline float finite_or_zero(float q) { return std::isfinite(q) ? q : 0.0f; }

#if defined(HVD_ONEBIT_X86)
// finite_or_zero, 8 at a time: |q| < inf is false for inf and NaN alike, and those lanes become +0
__attribute__((target("avx2,fma"))) inline __m256 finite_or_zero8(__m256 q) {
  const __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), q),
                                      _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                                      _CMP_LT_OQ);
  return _mm256_and_ps(q, finite);
}
#endif

void denominators_scalar(const float* v, float* out, int64_t numel, float inv_root_bc2,
                         float eps, bool divide) {
  for (int64_t p = 0; p < numel; ++p) {
    const float d = frozen_denominator(v[p], inv_root_bc2, eps);
    out[p] = divide ? finite_or_zero(out[p] / d) : d;
  }
}

#if defined(HVD_ONEBIT_X86)
__attribute__((target("avx2,fma"))) int64_t denominators_avx2(const float* v, float* out,
                                                               int64_t numel,
                                                               float inv_root_bc2, float eps,
                                                               bool divide) {
  int64_t p = 0;
  for (; p + 8 <= numel; p += 8) {
    const __m256 d = frozen_denominator8(v + p, inv_root_bc2, eps);
    const __m256 q = divide ? finite_or_zero8(_mm256_div_ps(_mm256_loadu_ps(out + p), d)) : d;
    _mm256_storeu_ps(out + p, q);
  }
  return p;
}
#endif

void denominators(const torch::Tensor& v, torch::Tensor out, double sqrt_bc2, double eps,
                  bool divide, bool allow_simd) {
  check_cpu(v, torch::kFloat32, "v", 0);
  check_cpu(out, torch::kFloat32, "out", v.numel());
  TORCH_CHECK(out.numel() == v.numel(), "out has ", out.numel(), " elements, v ", v.numel());
  const int64_t numel = v.numel();
  if (numel == 0) return;
  // Each scalar rounded to fp32 from double, as torch rounds a Python scalar.
  const float s = inverse_root_bc2(sqrt_bc2), e = static_cast<float>(eps);
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  int64_t p = 0;
#if defined(HVD_ONEBIT_X86)
  if (allow_simd && cpu_has_avx2()) p = denominators_avx2(vp, op, numel, s, e, divide);
#endif
  denominators_scalar(vp + p, op + p, numel - p, s, e, divide);
}

// ---- a variance refresh's moments, in one pass ------------------------------------------------
// For one parameter's piece of a bucket (engine/refresh.py), the torch ops it replaces, with their
// roundings: the old denominator d0 = frozen_denominator(v, sqrt_bc2_old, eps) (into `ratio`, when
// given); m.lerp_(g, 1 - beta1), which torch's CPU kernel computes as one FMA of the weight and
// g - m onto m (weight < 0.5; else of weight - 1 onto g); v.mul_(1 - a).addcmul_(g, g, value=a),
// which it computes as fma(a * g, g, v * (1 - a)); then ratio = d0 / frozen_denominator(v_new, sqrt_bc2_new, eps), every non-finite quotient +0. Four
// reads and three writes instead of the twin's fourteen.

struct RefreshPiece {
  float* m;
  float* v;
  const float* g;
  float* ratio;  // nullptr: no denominators
  float lerp_w, a, keep;  // 1 - beta1, the variance's weight a and 1 - a, each rounded to fp32
  float inv_root_bc2_old, inv_root_bc2_new, eps;  // 1 / sqrt_bc2 before and after
};

inline float lerp1(float m, float g, float w) {
  return std::fabs(w) < 0.5f ? std::fma(w, g - m, m) : std::fma(w - 1.0f, g - m, g);
}

inline void refresh1(const RefreshPiece& r, int64_t p) {
  const float v = r.v[p], g = r.g[p];
  const float d0 = r.ratio ? frozen_denominator(v, r.inv_root_bc2_old, r.eps) : 0.0f;
  r.m[p] = lerp1(r.m[p], g, r.lerp_w);
  const float vn = std::fma(r.a * g, g, v * r.keep);
  r.v[p] = vn;
  if (r.ratio) r.ratio[p] = finite_or_zero(d0 / frozen_denominator(vn, r.inv_root_bc2_new, r.eps));
}

#if defined(HVD_ONEBIT_X86)
__attribute__((target("avx2,fma"))) int64_t refresh_avx2(const RefreshPiece& r, int64_t numel) {
  const bool small = std::fabs(r.lerp_w) < 0.5f;
  const __m256 coeff = _mm256_set1_ps(small ? r.lerp_w : r.lerp_w - 1.0f);
  const __m256 a = _mm256_set1_ps(r.a), keep = _mm256_set1_ps(r.keep);
  int64_t p = 0;
  for (; p + 8 <= numel; p += 8) {
    const __m256 v = _mm256_loadu_ps(r.v + p), g = _mm256_loadu_ps(r.g + p);
    const __m256 m = _mm256_loadu_ps(r.m + p);
    const __m256 diff = _mm256_sub_ps(g, m);
    _mm256_storeu_ps(r.m + p, _mm256_fmadd_ps(coeff, diff, small ? m : g));
    const __m256 ag = _mm256_mul_ps(a, g);
    const __m256 vn = _mm256_fmadd_ps(ag, g, _mm256_mul_ps(v, keep));
    _mm256_storeu_ps(r.v + p, vn);
    if (!r.ratio) continue;
    _mm256_storeu_ps(r.ratio + p,
                     finite_or_zero8(_mm256_div_ps(denominator8(v, r.inv_root_bc2_old, r.eps),
                                                   denominator8(vn, r.inv_root_bc2_new, r.eps))));
  }
  return p;
}
#endif

void refresh_moments(torch::Tensor m, torch::Tensor v, const torch::Tensor& g,
                     const c10::optional<torch::Tensor>& ratio, double beta1, double weight,
                     double sqrt_bc2_old, double sqrt_bc2_new, double eps, bool allow_simd) {
  check_cpu(m, torch::kFloat32, "m", 0);
  const int64_t numel = m.numel();
  check_cpu(v, torch::kFloat32, "v", numel);
  check_cpu(g, torch::kFloat32, "g", numel);
  TORCH_CHECK(v.numel() == numel && g.numel() == numel, "m, v and g must have as many elements: ",
              numel, ", ", v.numel(), ", ", g.numel());
  float* out = nullptr;
  if (ratio.has_value() && ratio->defined()) {
    check_cpu(*ratio, torch::kFloat32, "ratio", numel);
    TORCH_CHECK(ratio->numel() == numel, "ratio has ", ratio->numel(), " elements, m ", numel);
    out = ratio->data_ptr<float>();
  }
  if (numel == 0) return;
  // Each scalar rounded to fp32 from double, as torch rounds a Python scalar; 1 - a and
  // 1 - beta1 computed in double first, as the Python expressions torch was given.
  const RefreshPiece r{m.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(), out,
                       static_cast<float>(1.0 - beta1), static_cast<float>(weight),
                       static_cast<float>(1.0 - weight), inverse_root_bc2(sqrt_bc2_old),
                       inverse_root_bc2(sqrt_bc2_new), static_cast<float>(eps)};
  pybind11::gil_scoped_release no_gil;
  int64_t p = 0;
#if defined(HVD_ONEBIT_X86)
  if (allow_simd && cpu_has_avx2()) p = refresh_avx2(r, numel);
#endif
  for (; p < numel; ++p) refresh1(r, p);
}

// ---- a factored error carried into new units (a variance refresh) -----------------------------
// y = (y - s * sign(y)) * ratio in place, for p < ratio.numel(), and y - s * sign(y) past it
// (elements whose units stay: the padding, a server chunk's tail past the buffer), s the block's
// scale in `scales`: the error rebuilt and scaled as the twin's e * ratio (fp32 subtraction, then
// multiplication), without materialising e. The caller then zeroes the scales, so y is the
// scaled error itself.

inline void rescale1(float* yp, const float* rp, int64_t nr, int64_t p, float s) {
  const float e = yp[p] - (yp[p] >= 0.0f ? s : -s);
  yp[p] = p < nr ? e * rp[p] : e;
}

#if defined(HVD_ONEBIT_X86)
// One block of rescale_error: groups of 8 whose factors are all in ratio as vectors (+-s by
// y's sign, as the compression's blend), the rest one at a time.
__attribute__((target("avx2,fma"))) void rescale_block_avx2(float* yp, const float* rp,
                                                            int64_t nr, int64_t base,
                                                            int64_t block, float s) {
  const __m256 pos_s = _mm256_set1_ps(s), neg_s = _mm256_set1_ps(-s);
  int64_t k = 0;
  for (; k + 8 <= block && base + k + 8 <= nr; k += 8) {
    float* y = yp + base + k;
    const __m256 yv = _mm256_loadu_ps(y);
    const __m256 d = _mm256_blendv_ps(neg_s, pos_s,
                                      _mm256_cmp_ps(yv, _mm256_setzero_ps(), _CMP_GE_OQ));
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_sub_ps(yv, d), _mm256_loadu_ps(rp + base + k)));
  }
  for (; k < block; ++k) rescale1(yp, rp, nr, base + k, s);
}
#endif

void rescale_error(torch::Tensor y, const torch::Tensor& scales, const torch::Tensor& ratio,
                   int64_t n, int64_t chunk, int64_t block, int64_t row_bytes,
                   bool allow_simd) {
  const Layout L = make_layout(n, chunk, block, row_bytes);
  check_cpu(y, torch::kFloat32, "y", n * chunk);
  check_cpu(scales, torch::kFloat32, "scales", n * L.nblocks());
  check_cpu(ratio, torch::kFloat32, "ratio", 0);
  TORCH_CHECK(y.numel() == n * chunk, "y has ", y.numel(), " elements, the layout ", n * chunk);
  TORCH_CHECK(ratio.numel() <= y.numel(), "ratio has more elements than y");
  const int64_t nr = ratio.numel(), nb = L.nblocks();
  float* yp = y.data_ptr<float>();
  const float* rp = ratio.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  bool simd = false;
#if defined(HVD_ONEBIT_X86)
  simd = allow_simd && cpu_has_avx2();
#endif
  (void)simd;
  pybind11::gil_scoped_release no_gil;
  for (int64_t j = 0; j < L.n; ++j) {
    for (int64_t b = 0; b < nb; ++b) {
      const float s = sp[j * nb + b];
      const int64_t base = j * L.chunk + b * L.block;
#if defined(HVD_ONEBIT_X86)
      if (simd) {
        rescale_block_avx2(yp, rp, nr, base, L.block, s);
        continue;
      }
#endif
      for (int64_t k = 0; k < L.block; ++k) rescale1(yp, rp, nr, base + k, s);
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hvd_onebit fused CPU kernels for 1-bit compressed allreduce";
  m.def("worker_compress", &worker_compress,
        "e = y_prev - s_prev*sign(y_prev), s_prev from prev_scales (float32 [n * nblocks]); "
        "y = x + e into y_out (None: not stored; may be y_prev); "
        "per-block rms scale and packed signs"
        " into send rows. Returns False if any block's sum of squares is not finite.");
  m.def("worker_compress_momentum", &worker_compress_momentum,
        "worker_compress of x = beta1 * m + (1 - beta1) * g, computed in the same pass; g is the "
        "list of gradient tensors (None = zeros) of the given sizes, end to end. With variances "
        "(one per gradient, and sqrt_bc2s, epss and bounds), clamp(x / (sqrt(v)*(1/sqrt_bc2) + "
        "eps), -bound, bound) instead (+-0 where v == 0); empty lists: not preconditioned.");
  m.def("worker_compress_mean", &worker_compress_mean,
        "worker_compress of x = (rows[0] + rows[1] + ...) / len(rows), summed in order in fp32, "
        "computed in the same pass.");
  m.def("momentum_update", &momentum_update,
        "out = beta1 * m + (1 - beta1) * g, g the gradients (None = zeros) of the given sizes, "
        "end to end: worker_compress_momentum's input, written out.");
  m.def("server_compress", &server_compress,
        "e = z_prev - s_prev*sign(z_prev), s_prev from prev_scales (float32 [nblocks]); z = "
        "mean of the n received rows + e into z_out (None: "
        "not stored; may be z_prev); "
        "compress z into out_row. Returns False if z is not finite.");
  m.def("decode", &decode, "out = s * sign for the n rows, first out.numel() elements.");
  m.def("decode_update", &decode_update,
        "decode into m and, for each weight given, denom = sqrt(v)*(1/sqrt_bc2) + eps (inf where "
        "v == 0), w = w*decay (if decay != 1) then w + clamp((step*m)/denom, -bound, bound), in "
        "the same pass. precond: the rows carry u = m/denom; m = u*denom (+0 where held) and "
        "w + clamp(step*u) (+0 where held); a variance may come without its weight.");
  m.def("update", &update,
        "m = src (+0 where v == 0) and, for each weight given, decode_update's weight update "
        "with d = src; src may be m.");
  m.def("denominators", &denominators,
        "out = sqrt(v)*(1/sqrt_bc2) + eps (inf where v == 0); with divide, out = out / that, every "
        "non-finite quotient set to +0 (a variance refresh's old / new denominator).");
  m.def("refresh_moments", &refresh_moments,
        "A variance refresh of one piece in one pass: ratio = old denominator (when given), "
        "m.lerp_(g, 1 - beta1), v.mul_(1 - a).addcmul_(g, g, value=a), then ratio = old / new denominator, every non-finite quotient +0.");
  m.def("rescale_error", &rescale_error,
        "y = (y - s*sign(y)) * ratio in place (y - s*sign(y) past ratio's end), s the block's "
        "scale in scales: a factored error scaled into new units; the caller then zeroes the "
        "scales.");
  m.def("has_avx2", &cpu_has_avx2, "Whether the AVX2 code path is available on this CPU.");
  m.def("has_avx512", &cpu_has_avx512,
        "Whether the AVX-512 paths (worker compression, decode and update) run on this CPU.");
  m.def("set_avx512", &set_avx512,
        "Allow (True, the default) or forbid the AVX-512 paths where the CPU has them (forbidden: "
        "AVX2, the same bits); returns whether they were allowed.");
}
