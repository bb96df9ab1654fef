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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* An element of the pool as float32: exact either way (every float16 is a float32). With F16C the loops
 * below convert 8 or 16 at a time; without it (the portable build) libgcc converts one by one. */
static inline __attribute__((always_inline)) float kv_at(const void *base, int64_t i, int half) {
    return half ? (float)((const _Float16 *)base)[i] : ((const float *)base)[i];
}

#define KVF_OK 0
#define KVF_BAD_TABLE 1
#define KVF_NO_MEMORY 2

/* Let the compiler call glibc's vector expf (libmvec) in the softmax loop. */
#pragma omp declare simd notinbranch
extern float expf(float);

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
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < head_dim; i++) dot += qh[i] * kv_at(k_cache, k + i, half);
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
#pragma omp simd
                for (int64_t i = 0; i < head_dim; i++) o[i] += p * kv_at(v_cache, v + i, half);
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
#pragma omp parallel for schedule(static, 1) num_threads(num_threads) if (rows > 1)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t ctx = context_lens[row], first = window > 0 && ctx > window ? ctx - window : 0;
        const int row_status = (kv_half ? attend_row_half : attend_row_float)(q + row * q_row_stride, k_cache, v_cache,
                                          block_tables + row * table_width, first, ctx,
                                          out + row * num_heads * head_dim, num_heads, num_heads / num_kv_heads,
                                          head_dim, page_size, num_kv_heads * head_dim, scale);
        if (row_status != KVF_OK) {
#pragma omp atomic write
            status = row_status;
        }
    }
    return status;
}
