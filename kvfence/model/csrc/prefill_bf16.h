/* The bf16 half of paged_prefill.c (included by it where PRE_BF16: AVX512-BF16): the chunk's two inner
 * products, q . k and p . v, as vdpbf16ps (two bf16 products a float32 lane, float32 accumulation), twice
 * the float32 fma's rate. q, K, V and the softmax weights are rounded to bf16 (round to nearest even); the
 * scores' scale, the softmax and the sums stay float32, as in the float32 half.
 *
 * What stays: a row's arithmetic depends on its position (and window) and the pool alone. A score is one
 * vdpbf16ps chain over head_dim's dim pairs from 0. Its output adds the weighted values pair of keys by
 * pair of keys, the pairs aligned to even absolute positions (keys 2m, 2m + 1), from the row's first
 * key: a row whose first key is odd adds that key alone first, one whose last key is even adds it alone
 * last (in float32: a key outside the row is never multiplied in, even by a zero weight). So chunked and
 * whole prefill give the same bits here too. head_dim need not be even (q and K padded with a zero dim)
 * nor a multiple of PRE_DIMS (the last dims summed in scalar, in the same pair order). */

typedef uint16_t ctx_elem; /* the context copy's element: a bf16's bits */
/* A thread's scratch: the float32 scores, then each row's bf16 weights, then each row's q pairs. */
#define PRE_PAIRS(head_dim) (((head_dim) + 1) / 2)
#define PRE_SCRATCH(stride, head_dim) (PRE_ROWS * PRE_HEADS * ((stride) + (stride) / 2 + PRE_PAIRS(head_dim)))

/* x rounded to the nearest bf16, ties to even (the inputs are finite: a pool's values and a query). */
static inline uint16_t bf16_of(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float float_of(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    __builtin_memcpy(&x, &u, sizeof x);
    return x;
}

static inline float pool_value(const void *cache, int64_t kv_half, int64_t i) {
    return kv_half ? (float)((const _Float16 *)cache)[i] : ((const float *)cache)[i];
}

/* The context in bf16: keys of kv head g in blocks of PRE_LANES keys, each block's dim pairs together (key
 * u = t - first, dims (2i, 2i + 1) at kb[g][u / L][i][u % L][0, 1]: a block's scores read one 64-byte
 * vector a pair); values as pairs of keys from the even key at or before `first` (keys 2m, 2m + 1 of dim d
 * at vb[g][m - first / 2][d][0, 1]: one vector holds 16 dims of a pair). Zeros wherever no key is. */
static int widen_context(const void *k_cache, const void *v_cache, int64_t kv_half, const int64_t *table,
                         int64_t first, int64_t ctx, int64_t num_kv_heads, int64_t head_dim, int64_t page_size,
                         struct pre_context *c) {
    const int64_t n = ctx - first, padded = PRE_ROUND(n), token_stride = num_kv_heads * head_dim;
    const int64_t pairs = PRE_PAIRS(head_dim), key_pairs = (ctx + 1) / 2 - first / 2;
    const int64_t key_head = padded * pairs * 2, value_head = key_pairs * 2 * head_dim;
    uint16_t *kb = calloc(num_kv_heads * (key_head + value_head), sizeof(uint16_t));
    if (kb == NULL) return KVF_NO_MEMORY;
    *c = (struct pre_context){kb, kb + num_kv_heads * key_head, key_head, value_head};
    for (int64_t t = first; t < ctx; t++) {
        const int64_t at = table[t / page_size] * page_size * token_stride + (t % page_size) * token_stride;
        const int64_t u = t - first, block = u / PRE_LANES * pairs * 2 * PRE_LANES + u % PRE_LANES * 2;
        for (int64_t g = 0; g < num_kv_heads; g++) {
            uint16_t *key = kb + g * key_head + block;
            uint16_t *value = (uint16_t *)c->values + g * value_head + (t / 2 - first / 2) * 2 * head_dim + t % 2;
            for (int64_t d = 0; d < head_dim; d++) {
                key[d / 2 * 2 * PRE_LANES + d % 2] = bf16_of(pool_value(k_cache, kv_half, at + g * head_dim + d));
                value[d * 2] = bf16_of(pool_value(v_cache, kv_half, at + g * head_dim + d));
            }
        }
    }
    return KVF_OK;
}

/* Row r's bf16 buffers in its thread's scratch (PRE_SCRATCH), and its first key counted from the even
 * key at or before the context's first. */
static inline void bf16_scratch(struct pre_row *row, int64_t r, float *scratch, int64_t first, int64_t stride,
                                int64_t head_dim) {
    uint16_t *weights = (uint16_t *)(scratch + PRE_ROWS * PRE_HEADS * stride);
    uint32_t *qb = (uint32_t *)(weights + PRE_ROWS * PRE_HEADS * stride);
    row->weights = weights + r * PRE_HEADS * stride;
    row->qb = qb + r * PRE_HEADS * PRE_PAIRS(head_dim);
    row->key0 = row->skip + first % 2;
}

/* The row's heads' q as bf16 dim pairs (a zero dim past an odd head_dim). */
static inline void query_pairs(const struct pre_row *r, int64_t nh, int64_t head_dim) {
    for (int64_t j = 0; j < nh; j++)
        for (int64_t d = 0; d < head_dim; d += 2) {
            const uint32_t hi = d + 1 < head_dim ? bf16_of(r->q[j * head_dim + d + 1]) : 0;
            r->qb[j * PRE_PAIRS(head_dim) + d / 2] = bf16_of(r->q[j * head_dim + d]) | hi << 16;
        }
}

/* The row's scores (q . k: one vdpbf16ps chain over the dim pairs from 0, times scale) for keys [lo, hi). */
static inline __attribute__((always_inline)) void score_chunk_bf16(const struct pre_row *r, const uint16_t *kb,
                                                                    int64_t lo, int64_t hi, const int64_t nh,
                                                                    int64_t pairs, int64_t stride, float scale) {
    const __m512 scaled = _mm512_set1_ps(scale);
    const int64_t from = r->skip > lo ? r->skip : lo, to = r->skip + r->span < hi ? r->skip + r->span : hi;
    for (int64_t b = from / PRE_LANES; b * PRE_LANES < to; b++) {
        const uint16_t *block = kb + b * pairs * 2 * PRE_LANES;
        __m512 acc[PRE_HEADS];
        for (int64_t j = 0; j < nh; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < pairs; i++) {
            const __m512bh keys = (__m512bh)_mm512_loadu_si512(block + i * 2 * PRE_LANES);
            for (int64_t j = 0; j < nh; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32((int)r->qb[j * pairs + i]), keys);
        }
        for (int64_t j = 0; j < nh; j++)
            _mm512_storeu_ps(r->scores + j * stride + PRE_LANES + b * PRE_LANES - r->skip, acc[j] * scaled);
    }
}

/* The row's softmax weights (float32, from softmax_row) rounded to bf16, counted from the row's first
 * pair: weights[k] is key key0 - key0 % 2 + k's (the slot before an odd first key is never read). */
static inline void weights_bf16(const struct pre_row *r, int64_t nh, int64_t stride) {
    const int64_t odd = r->key0 % 2;
    for (int64_t j = 0; j < nh; j++) {
        const float *s = r->scores + j * stride + PRE_LANES - odd; /* PRE_LANES floats before: in the buffer */
        for (int64_t k = 0; k < r->span + odd; k += PRE_LANES)
            _mm256_storeu_si256((__m256i *)(r->weights + j * stride + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + k)));
    }
}

/* out += w * v for key `key` (counted as key0) alone, in float32 from the bf16 weight and values. */
static inline void value_single(const struct pre_row *r, const uint16_t *vb, int64_t key, int64_t nh,
                                int64_t head_dim, int64_t stride) {
    const uint16_t *v = vb + key / 2 * 2 * head_dim + key % 2;
    for (int64_t j = 0; j < nh; j++) {
        const float w = float_of(r->weights[j * stride + key - (r->key0 - r->key0 % 2)]);
        for (int64_t d = 0; d < head_dim; d++) r->out[j * head_dim + d] = fmaf(w, float_of(v[d * 2]), r->out[j * head_dim + d]);
    }
}

/* out += p . v over the row's whole key pairs in [lo, hi) (pairs counted as vb's), pair by pair in order. */
static inline __attribute__((always_inline)) void values_chunk_bf16(const struct pre_row *r, const uint16_t *vb,
                                                                     int64_t lo, int64_t hi, const int64_t nh,
                                                                     int64_t head_dim, int64_t stride) {
    const int64_t first = (r->key0 + 1) / 2, last = (r->key0 + r->span) / 2; /* whole pairs [first, last) */
    const int64_t from = first > lo ? first : lo, to = last < hi ? last : hi;
    const int64_t pair0 = r->key0 / 2; /* the pair weights[0] starts */
    const uint32_t *w = (const uint32_t *)r->weights; /* w[j * stride / 2 + m - pair0]: pair m's */
    int64_t c = 0;
    for (; c + PRE_DIMS <= head_dim; c += PRE_DIMS) {
        __m512 acc[PRE_HEADS][4];
        for (int64_t j = 0; j < nh; j++)
            for (int k = 0; k < 4; k++) acc[j][k] = _mm512_loadu_ps(r->out + j * head_dim + c + k * PRE_LANES);
        for (int64_t m = from; m < to; m++) {
            const uint16_t *v = vb + (m * head_dim + c) * 2;
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(v), v1 = (__m512bh)_mm512_loadu_si512(v + 32),
                           v2 = (__m512bh)_mm512_loadu_si512(v + 64), v3 = (__m512bh)_mm512_loadu_si512(v + 96);
            for (int64_t j = 0; j < nh; j++) {
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)w[j * stride / 2 + m - pair0]);
                acc[j][0] = _mm512_dpbf16_ps(acc[j][0], p, v0);
                acc[j][1] = _mm512_dpbf16_ps(acc[j][1], p, v1);
                acc[j][2] = _mm512_dpbf16_ps(acc[j][2], p, v2);
                acc[j][3] = _mm512_dpbf16_ps(acc[j][3], p, v3);
            }
        }
        for (int64_t j = 0; j < nh; j++)
            for (int k = 0; k < 4; k++) _mm512_storeu_ps(r->out + j * head_dim + c + k * PRE_LANES, acc[j][k]);
    }
    for (int64_t j = 0; j < nh; j++)
        for (int64_t i = c; i < head_dim; i++)
            for (int64_t m = from; m < to; m++) {
                const uint16_t *pair = r->weights + j * stride + 2 * (m - pair0);
                const float w0 = float_of(pair[0]), w1 = float_of(pair[1]);
                const uint16_t *v = vb + (m * head_dim + i) * 2;
                r->out[j * head_dim + i] = fmaf(w1, float_of(v[1]), fmaf(w0, float_of(v[0]), r->out[j * head_dim + i]));
            }
}

/* Rows [0, count) of a task over the context's n keys: every row's scores chunk by chunk, then softmax and
 * its bf16 weights, then every row's values (a lone first key, the pairs chunk by chunk, a lone last key). */
static inline __attribute__((always_inline)) void prefill_rows(struct pre_row *rows, int64_t count,
                                                                const uint16_t *kb, const uint16_t *vb, int64_t n,
                                                                const int64_t nh, int64_t head_dim, int64_t stride,
                                                                float scale) {
    float total[PRE_ROWS][PRE_HEADS];
    const int64_t key_pairs = (n + rows[0].key0 - rows[0].skip + 1) / 2;
    for (int64_t r = 0; r < count; r++) query_pairs(rows + r, nh, head_dim);
    for (int64_t lo = 0; lo < n; lo += PRE_CHUNK)
        for (int64_t r = 0; r < count; r++)
            score_chunk_bf16(rows + r, kb, lo, lo + PRE_CHUNK, nh, PRE_PAIRS(head_dim), stride, scale);
    for (int64_t r = 0; r < count; r++) {
        softmax_row(rows + r, nh, stride, total[r]);
        weights_bf16(rows + r, nh, stride);
        for (int64_t i = 0; i < nh * head_dim; i++) rows[r].out[i] = 0.f;
        if (rows[r].key0 % 2) value_single(rows + r, vb, rows[r].key0, nh, head_dim, stride);
    }
    for (int64_t lo = 0; lo < key_pairs; lo += PRE_CHUNK / 2)
        for (int64_t r = 0; r < count; r++) values_chunk_bf16(rows + r, vb, lo, lo + PRE_CHUNK / 2, nh, head_dim, stride);
    for (int64_t r = 0; r < count; r++) {
        const int64_t last = rows[r].key0 + rows[r].span - 1;
        if (last % 2 == 0) value_single(rows + r, vb, last, nh, head_dim, stride);
        for (int64_t j = 0; j < nh; j++)
            for (int64_t i = 0; i < head_dim; i++) rows[r].out[j * head_dim + i] /= total[r][j];
    }
}
