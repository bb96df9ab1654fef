/* A decoder layer's row-wise work in C, and whole decode steps in one call.
 *
 * Why: a decode step of a small model is dominated by the dozen torch and C calls each layer makes per
 * step (norms, fused projections, RoPE, the cache write, attention, the residuals), not by arithmetic.
 * Here a layer is two calls around attention (`layer_qkv`, `layer_out`), and a step whose rows are all
 * decode rows is one call for every layer (`decode_layers`), attention included.
 *
 * Contract:
 *   - Every row is computed alone, in a fixed order (RMSNorm sums a row left to right; the matmuls are
 *     packed_matmul.c's over packed codes and half_matmul.c's over 16-bit weights (float32 rows, or
 *     bfloat16 rows in pairs), chosen per weight by its kind; the attention is paged_attention.c's): a
 *     row's result does not depend on the other rows of the step, so prefill and decode steps alike use
 *     these functions for every row on CPU float32.
 *   - 16-bit products are split over every thread whatever their size: a step's calls come back to back and
 *     find the pool awake (SmolLM2's 120 bfloat16 projections at one row, 212 MB: 6.9 ms on one thread,
 *     5.2 on two, as fast as the machine then read memory). Packed products keep packed_matmul.c's own
 *     threshold.
 *   - layer_qkv: x = norm(h); qkv = x @ Wqkv (+ bias); per-head norm of q and k (if the layer has them);
 *     RoPE on q and k with the step's angles at the layer's base; k and v written at each row's slot.
 *   - layer_out: h += post_norm(attn @ Wo); h += post_norm(down(act(gate) * up)) on norm(h).
 *   - decode_layers: for each layer, layer_qkv, decode attention of every row over its validated block
 *     table (paged_decode_attention), layer_out.
 *   - A status other than 0 (out of memory; a block table outside the pool) leaves the step unfinished:
 *     the caller fails it closed.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int packed_matmul(const float *x, int64_t x_stride, int64_t rows, const void *codes, const void *scales,
                  const void *offsets, int64_t in_features, int64_t group, int64_t panels, int64_t format,
                  float *y, int num_threads);
int paged_decode_attention(const float *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           int64_t kv_half, int64_t num_pages, const int64_t *block_tables, int64_t table_width,
                           const int64_t *context_lens, float *out, int64_t rows, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale,
                           int64_t window, int num_threads);
void half_matmul_threads(const float *x, int64_t x_stride, int64_t rows, const uint16_t *w, int64_t in_features,
                         int64_t out_features, int half, float *y, int num_threads);
int half_matmul_pairs_threads(const float *x, int64_t x_stride, int64_t rows, const uint16_t *w,
                              int64_t in_features, int64_t out_features, float *y, int num_threads);
void kvf_round_half(_Float16 *out, const float *values, int64_t n);

/* a weight's kind: which kernel multiplies by it (pairs: bfloat16 rows times bfloat16 weights) */
enum { KVF_PACKED, KVF_BF16, KVF_FP16, KVF_BF16_PAIRS };

typedef struct {
    const void *codes, *scales, *offsets; /* packed: as packed_matmul.c stores them, in `format`;
                                           * 16-bit: codes the panels half_matmul.c reads, no others */
    const float *bias;                    /* NULL for none */
    int64_t in_features, out_features, group, panels, format, kind;
} kvf_weight;

typedef struct {
    const float *attn_norm, *ffn_norm;
    const float *q_norm, *k_norm, *post_attn_norm, *post_ffn_norm; /* NULL where the layer has none */
    kvf_weight qkv, o, gate_up, down;
    int64_t local;  /* 1: RoPE at the local base, attention over the last `window` positions */
    int64_t window; /* 0: the whole context */
} kvf_layer;

typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    int64_t gelu; /* the MLP's gate: 0 SiLU, 1 tanh GELU */
    /* per step */
    void *kv;                   /* the pool [layers, 2, pages, page_size, kv_heads, head_dim] */
    int64_t kv_half;            /* 1: the pool holds float16 (K and V rounded to nearest as they are written) */
    int64_t num_pages, page_size;
    const int64_t *slots;       /* [rows] each row's new K/V slot (page * page_size + offset) */
    const int64_t *tables;      /* [rows, table_width] decode rows' validated block tables */
    int64_t table_width;
    const int64_t *context_lens; /* [rows] */
    const float *cos, *sin, *local_cos, *local_sin; /* [rows, head_dim] angles at the two bases */
    float *x, *qkv, *attn, *gate_up; /* scratch [rows, hidden / (heads + 2 kv) * hd / heads * hd / 2 inter] */
    int threads;
} kvf_step;

#define KVF_OK 0

/* Let the compiler call glibc's vector expf (libmvec) in the activation loop, as paged_common.h does. */
#pragma omp declare simd notinbranch
extern float expf(float);

/* The sum runs in SIMD lanes, in an order fixed by the row's length alone: the same for a row wherever it
 * sits in the batch. */
static void rms_norm(const float *x, int64_t n, const float *w, float eps, float *out) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float r = 1.f / sqrtf(sum / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* Rotate-half RoPE of one head: the first half pairs with the second. */
static void rope(float *v, const float *cos, const float *sin, int64_t d) {
    const int64_t half = d / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* gate[i] = act(gate[i]) * up[i]: SiLU, or GELU with tanh written through expf (tanh z = 1 - 2 / (e^2z + 1))
 * so that the loop vectorises with libmvec's expf alone. */
static void gated(float *gate, const float *up, int64_t n, int64_t gelu) {
    if (!gelu) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) gate[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
        return;
    }
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i], z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        gate[i] = 0.5f * g * (2.f - 2.f / (expf(2.f * z) + 1.f)) * up[i];
    }
}

static int matmul(const kvf_step *s, const float *x, int64_t x_stride, const kvf_weight *w, float *y) {
    int status = KVF_OK;
    if (w->kind == KVF_PACKED)
        status = packed_matmul(x, x_stride, s->rows, w->codes, w->scales, w->offsets, w->in_features, w->group,
                               w->panels, w->format, y, s->threads);
    else if (w->kind == KVF_BF16_PAIRS)
        status = half_matmul_pairs_threads(x, x_stride, s->rows, w->codes, w->in_features, w->out_features, y,
                                           s->threads);
    else
        half_matmul_threads(x, x_stride, s->rows, w->codes, w->in_features, w->out_features,
                            w->kind == KVF_FP16, y, s->threads);
    if (status != KVF_OK || w->bias == NULL) return status;
    const int64_t out = w->out_features;
    for (int64_t r = 0; r < s->rows; r++)
        for (int64_t j = 0; j < out; j++) y[r * out + j] += w->bias[j];
    return KVF_OK;
}

static void *layer_cache(const kvf_step *s, int64_t layer, int64_t kv) {
    const int64_t elements = s->num_pages * s->page_size * s->kv_heads * s->head_dim;
    return (char *)s->kv + (2 * layer + kv) * elements * (s->kv_half ? 2 : 4);
}

/* n values into the pool at element `at`: copied, or rounded to the nearest float16 (as torch's .half()). */
static void store_kv(void *cache, int64_t at, const float *values, int64_t n, int64_t half) {
    if (half)
        kvf_round_half((_Float16 *)cache + at, values, n);
    else
        memcpy((float *)cache + at, values, sizeof(float) * n);
}

int layer_qkv(const kvf_step *s, const kvf_layer *l, int64_t layer, const float *h) {
    const int64_t hd = s->head_dim, width = (s->heads + 2 * s->kv_heads) * hd;
#pragma omp parallel for num_threads(s->threads) if (s->rows > 4)
    for (int64_t r = 0; r < s->rows; r++)
        rms_norm(h + r * s->hidden, s->hidden, l->attn_norm, s->eps, s->x + r * s->hidden);
    const int status = matmul(s, s->x, s->hidden, &l->qkv, s->qkv);
    if (status != KVF_OK) return status;
    void *k_cache = layer_cache(s, layer, 0), *v_cache = layer_cache(s, layer, 1);
    const float *cos = l->local ? s->local_cos : s->cos, *sin = l->local ? s->local_sin : s->sin;
#pragma omp parallel for num_threads(s->threads) if (s->rows > 4)
    for (int64_t r = 0; r < s->rows; r++) {
        float *row = s->qkv + r * width;
        for (int64_t h = 0; h < s->heads + s->kv_heads; h++) {
            float *head = row + h * hd;
            const float *norm = h < s->heads ? l->q_norm : l->k_norm;
            if (norm != NULL) rms_norm(head, hd, norm, s->eps, head);
            rope(head, cos + r * hd, sin + r * hd, hd);
        }
        const int64_t at = s->slots[r] * s->kv_heads * hd;
        store_kv(k_cache, at, row + s->heads * hd, s->kv_heads * hd, s->kv_half);
        store_kv(v_cache, at, row + (s->heads + s->kv_heads) * hd, s->kv_heads * hd, s->kv_half);
    }
    return KVF_OK;
}

int layer_out(const kvf_step *s, const kvf_layer *l, float *h) {
    const int64_t n = s->hidden, inter = s->intermediate;
    int status = matmul(s, s->attn, s->heads * s->head_dim, &l->o, s->x);
    if (status != KVF_OK) return status;
#pragma omp parallel for num_threads(s->threads) if (s->rows > 4)
    for (int64_t r = 0; r < s->rows; r++) {
        float *x = s->x + r * n, *hr = h + r * n;
        if (l->post_attn_norm != NULL) rms_norm(x, n, l->post_attn_norm, s->eps, x);
        for (int64_t i = 0; i < n; i++) hr[i] += x[i];
        rms_norm(hr, n, l->ffn_norm, s->eps, x);
    }
    status = matmul(s, s->x, n, &l->gate_up, s->gate_up);
    if (status != KVF_OK) return status;
#pragma omp parallel for num_threads(s->threads) if (s->rows > 4)
    for (int64_t r = 0; r < s->rows; r++) {
        float *gate = s->gate_up + r * 2 * inter;
        gated(gate, gate + inter, inter, s->gelu);
    }
    status = matmul(s, s->gate_up, 2 * inter, &l->down, s->x);
    if (status != KVF_OK) return status;
#pragma omp parallel for num_threads(s->threads) if (s->rows > 4)
    for (int64_t r = 0; r < s->rows; r++) {
        float *x = s->x + r * n, *hr = h + r * n;
        if (l->post_ffn_norm != NULL) rms_norm(x, n, l->post_ffn_norm, s->eps, x);
        for (int64_t i = 0; i < n; i++) hr[i] += x[i];
    }
    return KVF_OK;
}

int decode_layers(const kvf_step *s, const kvf_layer *layers, int64_t num_layers, float *h) {
    const int64_t width = (s->heads + 2 * s->kv_heads) * s->head_dim;
    for (int64_t layer = 0; layer < num_layers; layer++) {
        const kvf_layer *l = layers + layer;
        int status = layer_qkv(s, l, layer, h);
        if (status != KVF_OK) return status;
        status = paged_decode_attention(s->qkv, width, layer_cache(s, layer, 0), layer_cache(s, layer, 1),
                                        s->kv_half, s->num_pages, s->tables, s->table_width, s->context_lens,
                                        s->attn, s->rows, s->heads, s->kv_heads, s->head_dim, s->page_size,
                                        s->scale, l->window, s->threads);
        if (status != KVF_OK) return status;
        status = layer_out(s, l, h);
        if (status != KVF_OK) return status;
    }
    return KVF_OK;
}
