#include "paged_common.h"

/* Prefill attention: the queries of one chunk, at positions [start, start + rows), over its context's pages
 * [0, ceil((start + rows) / page_size)) of `table` (its new K/V already written there).
 *
 * Why a kernel: SDPA's rounding changes with the shape of the call (how many queries and keys a chunk
 * has), and with int8 activations that moved SmolLM2's logits by up to 0.7 between a prompt prefilled whole
 * and in chunks. Here a query row's arithmetic depends on its position (and window) alone: every score is
 * one fma chain over head_dim from 0, its softmax runs over its own keys in a fixed order, and its output
 * adds p * v key by key from its first key, so a prompt's logits are the same bits however it is chunked
 * (and whatever shares the step). Speed (on a par with SDPA's flash kernel, measured) comes from a float32
 * copy of the context made once per call, keys in blocks of a vector's width; the query heads that share a
 * kv head computed together (each key vector read once for them); and 16 query rows at a time walking the
 * context in chunks of 256 keys, so a chunk is read from cache by every row of the task. Where the build has
 * AVX512-BF16 the two inner products run in bf16 instead (prefill_bf16.h, the same fixed orders: 1.75x
 * the float32 kernel at 6,000 tokens, bench/prefill_attention.py); float32 everywhere else.
 *
 * Contract: q [rows, num_heads, head_dim] (rows `q_row_stride` floats apart), out the same, contiguous;
 * the pool as for decode; window > 0: query p attends over keys (p - window, p] and no page before the
 * chunk's first query's window is read. Pages are checked before anything is read (KVF_BAD_TABLE). */
#ifdef HALF_LANES
#define PRE_LANES HALF_LANES
typedef lanes pre_lanes;
static inline pre_lanes pre_load(const float *p) { return lanes_load(p); }
static inline void pre_store(float *p, pre_lanes v) { lanes_store(p, v); }
static inline pre_lanes pre_fma(pre_lanes a, pre_lanes b, pre_lanes c) { return lanes_fma(a, b, c); }
static inline pre_lanes pre_zero(void) { return lanes_zero(); }
static inline pre_lanes pre_broadcast(float x) { return lanes_broadcast(x); }
#else
#define PRE_LANES 1
typedef float pre_lanes;
static inline pre_lanes pre_load(const float *p) { return *p; }
static inline void pre_store(float *p, pre_lanes v) { *p = v; }
static inline pre_lanes pre_fma(pre_lanes a, pre_lanes b, pre_lanes c) { return fmaf(a, b, c); }
static inline pre_lanes pre_zero(void) { return 0.f; }
static inline pre_lanes pre_broadcast(float x) { return x; }
#endif
#define PRE_HEADS 4 /* query heads of a group computed together (each reads the same keys) */
#define PRE_ROUND(n) (((n) + PRE_LANES - 1) / PRE_LANES * PRE_LANES)
/* AVX512-BF16 (-mavx512bf16, named where the CPU reports avx512_bf16): both inner products in bf16 (see
 * the bf16 section below); a build without it (or with -mno-avx512bf16: the float32 fallback) runs float32. */
#if defined(__AVX512BF16__) && PRE_LANES == 16
#define PRE_BF16
#endif

#define PRE_DIMS (4 * PRE_LANES) /* head dims a pass of p . v keeps in registers, per head */
#define PRE_ROWS 16                /* query rows of a task: they share each key chunk while it is in cache */
#define PRE_CHUNK 256              /* keys a pass reads (a multiple of PRE_LANES) */

/* A query row's heads [h0, h0 + nh) (nh <= PRE_HEADS, one kv head: kt, vf), its keys [skip, skip + span) of
 * the context. Each head's scores live in an aligned region of `scores` (`stride` floats a head, from
 * PRE_LANES on), so the softmax loop runs alike for every row of the same span whatever `skip` is. The
 * functions below are inlined per nh (accumulators in registers); a key chunk [lo, hi) is one pass. */
struct pre_row {
    const float *q;
    float *scores, *out;
    int64_t skip, span;
#ifdef PRE_BF16
    uint32_t *qb;      /* q's dims as bf16 pairs: head j's dims (2i, 2i + 1) at qb[j * pairs + i] */
    uint16_t *weights; /* softmax weights in bf16, head j's at weights[j * stride], from the row's first pair */
    int64_t key0;      /* the row's first key (its absolute position: key pairs are aligned to it) */
#endif
};

/* The call's copy of its context, one block per kv head (`key_head`, `value_head` elements apart). */
struct pre_context {
    void *keys, *values;
    int64_t key_head, value_head;
};

/* The row's scores (q . k, one fma chain over head_dim from 0, times scale) for its keys in [lo, hi). */
static inline __attribute__((always_inline)) void score_chunk(const struct pre_row *r, const float *kt, int64_t lo,
                                                               int64_t hi, const int64_t nh, int64_t head_dim,
                                                               int64_t stride, float scale) {
    const pre_lanes scaled = pre_broadcast(scale);
    const int64_t from = r->skip > lo ? r->skip : lo, to = r->skip + r->span < hi ? r->skip + r->span : hi;
    for (int64_t b = from / PRE_LANES; b * PRE_LANES < to; b++) {
        const float *block = kt + b * head_dim * PRE_LANES;
        pre_lanes acc[PRE_HEADS];
        for (int64_t j = 0; j < nh; j++) acc[j] = pre_zero();
        for (int64_t d = 0; d < head_dim; d++) {
            const pre_lanes keys = pre_load(block + d * PRE_LANES);
            for (int64_t j = 0; j < nh; j++) acc[j] = pre_fma(pre_broadcast(r->q[j * head_dim + d]), keys, acc[j]);
        }
        for (int64_t j = 0; j < nh; j++)
            pre_store(r->scores + j * stride + PRE_LANES + b * PRE_LANES - r->skip, acc[j] * scaled);
    }
}

/* The row's scores turned into exp(s - max) in place; each head's sum of them into total. */
static inline __attribute__((always_inline)) void softmax_row(const struct pre_row *r, const int64_t nh,
                                                               int64_t stride, float *total) {
    for (int64_t j = 0; j < nh; j++) {
        float *s = r->scores + j * stride + PRE_LANES, m = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < r->span; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < r->span; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        total[j] = sum;
    }
}

/* out += p . v over the row's keys in [lo, hi), key by key in order (out starts at zero). */
static inline __attribute__((always_inline)) void values_chunk(const struct pre_row *r, const float *vf, int64_t lo,
                                                                int64_t hi, const int64_t nh, int64_t head_dim,
                                                                int64_t stride) {
    const int64_t from = r->skip > lo ? r->skip : lo, to = r->skip + r->span < hi ? r->skip + r->span : hi;
    const float *p = r->scores + PRE_LANES - r->skip; /* p[j * stride + t]: head j's weight of key t */
    int64_t c = 0;
    for (; c + PRE_DIMS <= head_dim; c += PRE_DIMS) {
        pre_lanes acc[PRE_HEADS][4];
        for (int64_t j = 0; j < nh; j++)
            for (int k = 0; k < 4; k++) acc[j][k] = pre_load(r->out + j * head_dim + c + k * PRE_LANES);
        for (int64_t t = from; t < to; t++) {
            const float *v = vf + t * head_dim + c;
            const pre_lanes v0 = pre_load(v), v1 = pre_load(v + PRE_LANES), v2 = pre_load(v + 2 * PRE_LANES),
                            v3 = pre_load(v + 3 * PRE_LANES);
            for (int64_t j = 0; j < nh; j++) {
                const pre_lanes w = pre_broadcast(p[j * stride + t]);
                acc[j][0] = pre_fma(w, v0, acc[j][0]);
                acc[j][1] = pre_fma(w, v1, acc[j][1]);
                acc[j][2] = pre_fma(w, v2, acc[j][2]);
                acc[j][3] = pre_fma(w, v3, acc[j][3]);
            }
        }
        for (int64_t j = 0; j < nh; j++)
            for (int k = 0; k < 4; k++) pre_store(r->out + j * head_dim + c + k * PRE_LANES, acc[j][k]);
    }
    for (int64_t j = 0; j < nh; j++)
        for (int64_t i = c; i < head_dim; i++)
            for (int64_t t = from; t < to; t++)
                r->out[j * head_dim + i] = fmaf(p[j * stride + t], vf[t * head_dim + i], r->out[j * head_dim + i]);
}

#ifndef PRE_BF16
typedef float ctx_elem; /* the context copy's element */
#define PRE_SCRATCH(stride, head_dim) (PRE_ROWS * PRE_HEADS * (stride)) /* floats of a thread's scratch */

/* The context's keys [first, ctx) of kv head g in blocks of PRE_LANES keys, each block's head_dim vectors
 * together (key t at kt[g][(t - first) / L][d][(t - first) % L], zeros past the last key): a block's
 * scores read 64 contiguous vectors. Values as vf[g][t - first][d]. All float32. */
static int widen_context(const void *k_cache, const void *v_cache, int64_t kv_half, const int64_t *table,
                         int64_t first, int64_t ctx, int64_t num_kv_heads, int64_t head_dim, int64_t page_size,
                         struct pre_context *c) {
    const int64_t n = ctx - first, padded = PRE_ROUND(n), token_stride = num_kv_heads * head_dim;
    float *kt = malloc(sizeof(float) * num_kv_heads * head_dim * (padded + n)), *vf;
    if (kt == NULL) return KVF_NO_MEMORY;
    vf = kt + num_kv_heads * head_dim * padded;
    *c = (struct pre_context){kt, vf, head_dim * padded, n * head_dim};
    for (int64_t i = 0; i < num_kv_heads * head_dim * padded; i++) kt[i] = 0.f;
    for (int64_t t = first; t < ctx; t++) {
        const int64_t at = table[t / page_size] * page_size * token_stride + (t % page_size) * token_stride;
        const int64_t u = t - first, block = u / PRE_LANES * head_dim * PRE_LANES + u % PRE_LANES;
        for (int64_t g = 0; g < num_kv_heads; g++) {
            float *key = kt + g * head_dim * padded + block, *value = vf + (g * n + u) * head_dim;
            const int64_t i = at + g * head_dim;
            for (int64_t d = 0; d < head_dim; d++) {
                key[d * PRE_LANES] = kv_half ? (float)((const _Float16 *)k_cache)[i + d] : ((const float *)k_cache)[i + d];
                value[d] = kv_half ? (float)((const _Float16 *)v_cache)[i + d] : ((const float *)v_cache)[i + d];
            }
        }
    }
    return KVF_OK;
}

/* Rows [0, count) of a task over the context's n keys, chunk by chunk: every row's scores, then softmax,
 * then every row's values; a row's sums run in the same order whatever rows share the task. */
static inline __attribute__((always_inline)) void prefill_rows(struct pre_row *rows, int64_t count, const float *kt,
                                                                const float *vf, int64_t n, const int64_t nh,
                                                                int64_t head_dim, int64_t stride, float scale) {
    float total[PRE_ROWS][PRE_HEADS];
    for (int64_t lo = 0; lo < n; lo += PRE_CHUNK)
        for (int64_t r = 0; r < count; r++) score_chunk(rows + r, kt, lo, lo + PRE_CHUNK, nh, head_dim, stride, scale);
    for (int64_t r = 0; r < count; r++) {
        softmax_row(rows + r, nh, stride, total[r]);
        for (int64_t i = 0; i < nh * head_dim; i++) rows[r].out[i] = 0.f;
    }
    for (int64_t lo = 0; lo < n; lo += PRE_CHUNK)
        for (int64_t r = 0; r < count; r++) values_chunk(rows + r, vf, lo, lo + PRE_CHUNK, nh, head_dim, stride);
    for (int64_t r = 0; r < count; r++)
        for (int64_t j = 0; j < nh; j++)
            for (int64_t i = 0; i < head_dim; i++) rows[r].out[j * head_dim + i] /= total[r][j];
}

#else
#include "prefill_bf16.h"
#endif

static void prefill_task(struct pre_row *rows, int64_t count, const ctx_elem *kt, const ctx_elem *vf, int64_t n,
                         int64_t nh, int64_t head_dim, int64_t stride, float scale) {
    switch (nh) {
    case 1: prefill_rows(rows, count, kt, vf, n, 1, head_dim, stride, scale); break;
    case 2: prefill_rows(rows, count, kt, vf, n, 2, head_dim, stride, scale); break;
    case 3: prefill_rows(rows, count, kt, vf, n, 3, head_dim, stride, scale); break;
    default: prefill_rows(rows, count, kt, vf, n, PRE_HEADS, head_dim, stride, scale);
    }
}

int paged_prefill_attention(const float *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                            int64_t kv_half, int64_t num_pages, const int64_t *table, int64_t table_len,
                            int64_t start, int64_t rows, float *out, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t page_size, float scale, int64_t window, int num_threads) {
    const int64_t ctx = start + rows, first = window > 0 && start + 1 > window ? start + 1 - window : 0;
    if (rows < 1 || start < 0 || ctx > table_len * page_size) return KVF_BAD_TABLE;
    for (int64_t p = first / page_size; p < (ctx + page_size - 1) / page_size; p++)
        if (table[p] < 0 || table[p] >= num_pages) return KVF_BAD_TABLE;
    const int64_t n = ctx - first, padded = PRE_ROUND(n), group = num_heads / num_kv_heads;
    const int64_t stride = padded + 2 * PRE_LANES; /* floats of a head's scores (see struct pre_row) */
    struct pre_context c;
    int status = widen_context(k_cache, v_cache, kv_half, table, first, ctx, num_kv_heads, head_dim, page_size, &c);
    if (status != KVF_OK) return status;
    const int64_t tiles = (group + PRE_HEADS - 1) / PRE_HEADS, row_tiles = (rows + PRE_ROWS - 1) / PRE_ROWS;
    const int64_t tasks = row_tiles * num_kv_heads * tiles;
#pragma omp parallel num_threads(num_threads) if (tasks > 1)
    {
        float *scores = aligned_alloc(64, (sizeof(float) * PRE_SCRATCH(stride, head_dim) + 63) / 64 * 64);
        if (scores == NULL) {
#pragma omp atomic write
            status = KVF_NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (scores == NULL) continue;
            const int64_t row0 = task / (num_kv_heads * tiles) * PRE_ROWS, g = task / tiles % num_kv_heads;
            const int64_t h0 = g * group + task % tiles * PRE_HEADS;
            const int64_t nh = g * group + group - h0 < PRE_HEADS ? g * group + group - h0 : PRE_HEADS;
            const int64_t count = rows - row0 < PRE_ROWS ? rows - row0 : PRE_ROWS;
            struct pre_row tile[PRE_ROWS];
            for (int64_t r = 0; r < count; r++) {
                const int64_t p = start + row0 + r, row_first = window > 0 && p + 1 > window ? p + 1 - window : 0;
                tile[r] = (struct pre_row){q + (row0 + r) * q_row_stride + h0 * head_dim,
                                           scores + r * PRE_HEADS * stride, out + ((row0 + r) * num_heads + h0) * head_dim,
                                           row_first - first, p + 1 - row_first};
#ifdef PRE_BF16
                bf16_scratch(tile + r, r, scores, first, stride, head_dim);
#endif
            }
            prefill_task(tile, count, (const ctx_elem *)c.keys + g * c.key_head,
                         (const ctx_elem *)c.values + g * c.value_head, n, nh, head_dim, stride, scale);
        }
        free(scores);
    }
    free(c.keys);
    return status;
}
