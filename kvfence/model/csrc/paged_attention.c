/* Decode attention straight over the paged KV pool: one query token per row, float32 arithmetic over a
 * pool of float32 or float16 (`kv_half`: half the bytes read, which is what decode attention waits on).
 *
 * Why a kernel: the torch path gathers every row's pages into a padded copy and then runs SDPA over it,
 * so each step reads the KV three times (gather read, gather write, attention read) and pays SDPA's
 * per-call set-up for a single query. Here each row reads its own pages once, in place.
 *
 * Contract:
 *   q             [rows, num_heads, head_dim], rows `q_row_stride` floats apart, heads contiguous
 *   k_cache/v_cache [num_pages, page_size, num_kv_heads, head_dim], contiguous (one layer of the pool),
 *                 float32, or float16 where kv_half is 1
 *   block_tables  [rows, table_width] int64; row r reads pages block_tables[r][0 .. ceil(ctx/page_size))
 *   context_lens  [rows] int64; row r's context: its tokens [0, context_lens[r])
 *   window        > 0: row r attends over its last `window` tokens only (a sliding-window layer), never
 *                 reading the pages before them; 0: over its whole context
 *   out           [rows, num_heads, head_dim], contiguous
 * Query head h reads KV head h / (num_heads / num_kv_heads), as HF's repeat_kv does.
 *
 * Every page id and length is checked before anything is read: a bad block table returns
 * KVF_BAD_TABLE and reads nothing, so a bookkeeping error fails closed instead of reading memory
 * outside the pool. Rows are independent and computed in a fixed order, so a row's output does not depend
 * on what it is batched with.
 */
#include "paged_common.h"

/* q . k over n values, k in float16. */
static inline float half_dot(const float *q, const _Float16 *k, int64_t n) {
    int64_t i = 0;
    float dot = 0.f;
#ifdef HALF_LANES
    lanes acc = lanes_zero();
    for (; i + HALF_LANES <= n; i += HALF_LANES) acc = lanes_fma(lanes_load(q + i), lanes_of_half(k + i), acc);
    dot = lanes_sum(acc);
#endif
    for (; i < n; i++) dot += q[i] * (float)k[i];
    return dot;
}

/* o += p * v over n values, v in float16. */
static inline void half_axpy(float *o, float p, const _Float16 *v, int64_t n) {
    int64_t i = 0;
#ifdef HALF_LANES
    const lanes weight = lanes_broadcast(p);
    for (; i + HALF_LANES <= n; i += HALF_LANES)
        lanes_store(o + i, lanes_fma(weight, lanes_of_half(v + i), lanes_load(o + i)));
#endif
    for (; i < n; i++) o[i] += p * (float)v[i];
}

/* out = values rounded to the nearest float16 (ties to even, as torch's .half()): the C layer's writes of K
 * and V into a float16 pool. */
void kvf_round_half(_Float16 *out, const float *values, int64_t n) {
    int64_t i = 0;
#ifdef HALF_LANES
    for (; i + HALF_LANES <= n; i += HALF_LANES) lanes_store_half(out + i, lanes_load(values + i));
#endif
    for (; i < n; i++) out[i] = (_Float16)values[i];
}


static int tables_are_valid(const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                            int64_t rows, int64_t page_size, int64_t num_pages) {
    for (int64_t row = 0; row < rows; row++) {
        const int64_t ctx = context_lens[row];
        if (ctx < 1 || ctx > table_width * page_size) return 0;
        const int64_t *table = block_tables + row * table_width;
        for (int64_t p = 0; p < (ctx + page_size - 1) / page_size; p++)
            if (table[p] < 0 || table[p] >= num_pages) return 0;
    }
    return 1;
}

/* One row over tokens [first, ctx): scores[h][t] = q_h . k_t * scale, softmax over t, out_h = sum_t p v_t.
 * The walk goes page by page from the page holding `first`, so no page before the window is touched. */
static inline __attribute__((always_inline)) int attend_row(const int half, const float *q, const void *k_cache,
                                                           const void *v_cache, const int64_t *table,
                                                           int64_t first, int64_t ctx, float *out,
                                                           int64_t num_heads, int64_t group, int64_t head_dim,
                                                           int64_t page_size, int64_t token_stride, float scale) {
    const int64_t page_stride = page_size * token_stride, span = ctx - first;
    float *scores = malloc(sizeof(float) * num_heads * (span + 2));
    if (scores == NULL) return KVF_NO_MEMORY;
    float *row_max = scores + num_heads * span, *row_sum = row_max + num_heads;
    for (int64_t h = 0; h < num_heads; h++) row_max[h] = -INFINITY;
    for (int64_t t = first; t < ctx;) {
        const int64_t slot = t % page_size, n = ctx - t < page_size - slot ? ctx - t : page_size - slot;
        const int64_t page = table[t / page_size] * page_stride + slot * token_stride;
        for (int64_t j = 0; j < n; j++)
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t k = page + j * token_stride + (h / group) * head_dim;
                const float *qh = q + h * head_dim;
                float dot = 0.f;
                if (half) {
                    dot = half_dot(qh, (const _Float16 *)k_cache + k, head_dim);
                } else {
                    const float *kf = (const float *)k_cache + k;
#pragma omp simd reduction(+ : dot)
                    for (int64_t i = 0; i < head_dim; i++) dot += qh[i] * kf[i];
                }
                dot *= scale;
                scores[h * span + t - first + j] = dot;
                row_max[h] = dot > row_max[h] ? dot : row_max[h];
            }
        t += n;
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float *s = scores + h * span, total = 0.f;
        const float m = row_max[h];
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < span; t++) {
            s[t] = expf(s[t] - m);
            total += s[t];
        }
        row_sum[h] = total;
    }
    for (int64_t i = 0; i < num_heads * head_dim; i++) out[i] = 0.f;
    for (int64_t t = first; t < ctx;) {
        const int64_t slot = t % page_size, n = ctx - t < page_size - slot ? ctx - t : page_size - slot;
        const int64_t page = table[t / page_size] * page_stride + slot * token_stride;
        for (int64_t j = 0; j < n; j++)
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t v = page + j * token_stride + (h / group) * head_dim;
                const float p = scores[h * span + t - first + j];
                float *o = out + h * head_dim;
                if (half) {
                    half_axpy(o, p, (const _Float16 *)v_cache + v, head_dim);
                    continue;
                }
                const float *vf = (const float *)v_cache + v;
#pragma omp simd
                for (int64_t i = 0; i < head_dim; i++) o[i] += p * vf[i];
            }
        t += n;
    }
    for (int64_t h = 0; h < num_heads; h++)
        for (int64_t i = 0; i < head_dim; i++) out[h * head_dim + i] /= row_sum[h];
    free(scores);
    return KVF_OK;
}

/* One function per pool element type, so that the conversion is resolved at compile time. */
#define ATTEND_ROW(NAME, HALF)                                                                            \
    static int NAME(const float *q, const void *k_cache, const void *v_cache, const int64_t *table,          \
                    int64_t first, int64_t ctx, float *out, int64_t num_heads, int64_t group,                \
                    int64_t head_dim, int64_t page_size, int64_t token_stride, float scale) {                \
        return attend_row(HALF, q, k_cache, v_cache, table, first, ctx, out, num_heads, group, head_dim,     \
                          page_size, token_stride, scale);                                                   \
    }
ATTEND_ROW(attend_row_float, 0)
ATTEND_ROW(attend_row_half, 1)

int paged_decode_attention(const float *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           int64_t kv_half, int64_t num_pages, const int64_t *block_tables, int64_t table_width,
                           const int64_t *context_lens, float *out, int64_t rows, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale,
                           int64_t window, int num_threads) {
    if (!tables_are_valid(block_tables, table_width, context_lens, rows, page_size, num_pages))
        return KVF_BAD_TABLE;
    int status = KVF_OK;
    int (*const attend)(const float *, const void *, const void *, const int64_t *, int64_t, int64_t, float *,
                        int64_t, int64_t, int64_t, int64_t, int64_t, float) =
        kv_half ? attend_row_half : attend_row_float;
#pragma omp parallel for schedule(static, 1) num_threads(num_threads) if (rows > 1)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t ctx = context_lens[row], first = window > 0 && ctx > window ? ctx - window : 0;
        const int row_status = attend(q + row * q_row_stride, k_cache, v_cache, block_tables + row * table_width,
                                      first, ctx, out + row * num_heads * head_dim, num_heads,
                                      num_heads / num_kv_heads, head_dim, page_size, num_kv_heads * head_dim, scale);
        if (row_status != KVF_OK) {
#pragma omp atomic write
            status = row_status;
        }
    }
    return status;
}
