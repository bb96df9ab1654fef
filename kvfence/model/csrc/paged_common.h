/* What the paged attention kernels (paged_attention.c: decode, paged_prefill.c: prefill) share: their
 * status codes, the vector lanes of this build's instruction set, the vector expf of their softmax loops. */
#ifndef KVF_PAGED_COMMON_H
#define KVF_PAGED_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define KVF_OK 0
#define KVF_BAD_TABLE 1
#define KVF_NO_MEMORY 2

/* Let the compiler call glibc's vector expf (libmvec) in the softmax loop. */
#pragma omp declare simd notinbranch
extern float expf(float);

/* Float16 K and V widened to float32 (exactly: every float16 is a float32) inside a dot product and a
 * scaled add over one head (paged_attention.c's half_dot, half_axpy), and rounded from float32 as the C
 * layer writes them: 16 or 8 at a time where the CPU converts vectors (AVX-512, F16C). GCC converts
 * _Float16 one element at a time (the kernel ran 7.5x slower over a float16 pool than over a float32 one),
 * so the vector loops are written out. The order of the sums depends on head_dim alone: a row computes
 * alike in any batch. */
#if defined(__AVX512F__) && !defined(KVF_PORTABLE)
#include <immintrin.h>
#define HALF_LANES 16
typedef __m512 lanes;
static inline lanes lanes_of_half(const _Float16 *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline lanes lanes_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void lanes_store(float *p, lanes v) { _mm512_storeu_ps(p, v); }
static inline lanes lanes_fma(lanes a, lanes b, lanes c) { return _mm512_fmadd_ps(a, b, c); }
static inline lanes lanes_zero(void) { return _mm512_setzero_ps(); }
static inline lanes lanes_broadcast(float x) { return _mm512_set1_ps(x); }
static inline float lanes_sum(lanes v) { return _mm512_reduce_add_ps(v); }
static inline void lanes_store_half(_Float16 *p, lanes v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(__F16C__) && defined(__FMA__) && defined(__AVX__) && !defined(KVF_PORTABLE)
#include <immintrin.h>
#define HALF_LANES 8
typedef __m256 lanes;
static inline lanes lanes_of_half(const _Float16 *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline lanes lanes_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void lanes_store(float *p, lanes v) { _mm256_storeu_ps(p, v); }
static inline lanes lanes_fma(lanes a, lanes b, lanes c) { return _mm256_fmadd_ps(a, b, c); }
static inline lanes lanes_zero(void) { return _mm256_setzero_ps(); }
static inline lanes lanes_broadcast(float x) { return _mm256_set1_ps(x); }
static inline float lanes_sum(lanes v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}
static inline void lanes_store_half(_Float16 *p, lanes v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif
#endif
