/* A GGUF weight's blocks laid straight into packed_matmul.c's panels, once, at load.
 *
 * Why: the general path (packed_matmul.py's PackedWeight.pack over the codes gguf-py decodes) passes over
 * every weight about ten times in numpy and torch: 7 of the ~10 s the 1.07B Q4_0 file took to be served.
 * Here each block is read once and its codes written where the kernel reads them.
 *
 * Contract: `blocks` holds a weight's rows, each of in_features / 32 blocks (/ 256 for K-quants) of the
 * format `kind` (ggml's type ids: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; any other returns -1 and
 * writes nothing).
 * Output feature n reads stored row rows[n] (llama's Q/K rows are reordered). Each block decodes to codes
 * and, per group of `group` weights (16 for Q6_K, else 32), a float32 scale and offset with
 * w = code * scale + offset, computed as gguf-py computes them (a K-quant's scale is d x its 6-bit scale
 * in one float32 product, its offset -(dmin x min)). The 4-bit formats' codes are q as stored, 0-15 (Q4_0's
 * offset then -8 x d); the others' as gguf-py's unit blocks give them (Q5_0 q - 16, Q6_K q - 32, Q8_0 the
 * int8, Q5_1 and Q5_K q). Writes panels [0, out_features / PANEL) (the caller points at a part's first
 * panel within a fused projection):
 *   codes    `layout` NIBBLES (4-bit formats): [panels, in, PANEL / 2], byte j of row k holding column
 *            j's code low and column j + 16's high; DOT (4-bit, group 32): [panels, in / 8, 2, 64], byte
 *            4j + i of line (t, h) holding column 16h + j's code for k = 8t + i low and k = 8t + 4 + i
 *            high; BYTES (any): [panels, in, PANEL] int8; BYTE_DOT (byte codes, group 32): [panels, in / 4,
 *            2, 64] int8, byte 4j + i of line (t, h) holding column 16h + j's code for k = 4t + i
 *   scales, offsets  [panels, in / group, PANEL] float32
 * Which storage the scales take (float16 where it holds them exactly) and whether offsets are stored at
 * all is packed_matmul.py's call (`narrow_scales`), as on the general path. Every code byte is written whole,
 * so the output need not be cleared first.
 */
#include <stdint.h>
#include <string.h>

#define PANEL 32 /* as packed_matmul.c */
#define MAX_WEIGHTS 256 /* a K-quant's super-block */
#define MAX_GROUPS 16
#define BYTES 0
#define NIBBLES 1
#define DOT 2
#define BYTE_DOT 3

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* IEEE half to float, exactly (as numpy's astype(float32)): every half is a float. */
static float half(const uint8_t *at) {
    uint16_t h;
    memcpy(&h, at, 2);
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, mantissa = h & 1023;
    uint32_t bits = sign;
    if (exponent == 31)
        bits |= 0x7F800000u | mantissa << 13;
    else if (exponent)
        bits |= (exponent + 112) << 23 | mantissa << 13;
    else if (mantissa) { /* subnormal: normalised, one exponent step per shift */
        uint32_t m = mantissa, e = 113;
        while (!(m & 1024))
            m <<= 1, e--;
        bits |= e << 23 | (m & 1023) << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Byte j of 16 holds weight j low and j + 16 high; Q5's fifth bits are the little-endian word qh's. */
static void nibbles32(const uint8_t *qs, const uint8_t *qh, int bias, int8_t *q) {
    uint32_t high = 0;
    if (qh)
        memcpy(&high, qh, 4);
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)((qs[j] & 15 | ((high >> j) & 1) << 4) - bias);
        q[j + 16] = (int8_t)((qs[j] >> 4 | ((high >> (j + 16)) & 1) << 4) - bias);
    }
}

/* A K-quant's 8 (6-bit scale, 6-bit min) pairs, packed in 12 bytes. */
static void k_scales(const uint8_t *s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | (s[j] >> 6) << 4;
        mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
    }
}

/* One block: its codes, and each group's scale and offset. */
static void decode(int kind, const uint8_t *b, int8_t *q, float *scale, float *offset) {
    switch (kind) {
    case Q4_0:
        nibbles32(b + 2, NULL, 0, q), scale[0] = half(b), offset[0] = -8.0f * scale[0];
        return;
    case Q4_1:
        nibbles32(b + 4, NULL, 0, q), scale[0] = half(b), offset[0] = half(b + 2);
        return;
    case Q5_0:
        nibbles32(b + 6, b + 2, 16, q), scale[0] = half(b), offset[0] = 0.0f;
        return;
    case Q5_1:
        nibbles32(b + 8, b + 4, 0, q), scale[0] = half(b), offset[0] = half(b + 2);
        return;
    case Q8_0:
        memcpy(q, b + 2, 32), scale[0] = half(b), offset[0] = 0.0f;
        return;
    case Q4_K:
    case Q5_K: { /* d, dmin, scales, [Q5_K: qh 32], qs 128: 32-byte chunk c gives sub-blocks 2c, 2c + 1 */
        const float d = half(b), dmin = half(b + 2);
        const uint8_t *qh = kind == Q5_K ? b + 16 : NULL, *qs = b + (kind == Q5_K ? 48 : 16);
        int sc[8], mn[8];
        k_scales(b + 4, sc, mn);
        for (int s = 0; s < 8; s++) {
            scale[s] = d * (float)sc[s], offset[s] = -(dmin * (float)mn[s]);
            for (int l = 0; l < 32; l++) {
                const int low = qs[32 * (s / 2) + l] >> (4 * (s % 2)) & 15;
                q[32 * s + l] = (int8_t)(low | (qh ? (qh[l] >> s & 1) << 4 : 0));
            }
        }
        return;
    }
    case Q6_K: { /* ql 128, qh 64, 16 int8 scales, d: chunk 4h + c of 32 from ql / qh's half h */
        const float d = half(b + 208);
        for (int g = 0; g < 16; g++)
            scale[g] = d * (float)(int8_t)b[192 + g], offset[g] = 0.0f;
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) {
                    const int low = b[64 * h + 32 * (c % 2) + l] >> (4 * (c / 2)) & 15;
                    const int high = b[128 + 32 * h + l] >> (2 * c) & 3;
                    q[128 * h + 32 * c + l] = (int8_t)((low | high << 4) - 32);
                }
        return;
    }
    }
}

/* Weights a block of `kind` holds, its bytes and its group; 0 weights for a kind not packed here. */
static void shape_of(int kind, int *weights, int *bytes, int *group) {
    *weights = 32, *group = 32;
    switch (kind) {
    case Q4_0: *bytes = 18; return;
    case Q4_1: *bytes = 20; return;
    case Q5_0: *bytes = 22; return;
    case Q5_1: *bytes = 24; return;
    case Q8_0: *bytes = 34; return;
    case Q4_K: *weights = 256, *bytes = 144; return;
    case Q5_K: *weights = 256, *bytes = 176; return;
    case Q6_K: *weights = 256, *bytes = 210, *group = 16; return;
    default: *weights = 0;
    }
}

/* Codes [PANEL][weights] of one block column by column, written at k0 in `layout`. */
static void write_codes(int8_t q[PANEL][MAX_WEIGHTS], int weights, int layout, int64_t p, int64_t k0,
                        int64_t in_features, uint8_t *codes) {
    if (layout == DOT) {
        uint8_t *lines = codes + (p * (in_features / 8) + k0 / 8) * 2 * 64;
        for (int t = 0; t < weights / 8; t++)
            for (int c = 0; c < PANEL; c++)
                for (int i = 0; i < 4; i++)
                    lines[(t * 2 + c / 16) * 64 + 4 * (c % 16) + i] =
                        (uint8_t)(q[c][8 * t + i] | q[c][8 * t + 4 + i] << 4);
    } else if (layout == BYTE_DOT) {
        uint8_t *lines = codes + (p * (in_features / 4) + k0 / 4) * 2 * 64;
        for (int t = 0; t < weights / 4; t++)
            for (int c = 0; c < PANEL; c++)
                for (int i = 0; i < 4; i++)
                    lines[(t * 2 + c / 16) * 64 + 4 * (c % 16) + i] = (uint8_t)q[c][4 * t + i];
    } else if (layout == NIBBLES) {
        uint8_t *row = codes + (p * in_features + k0) * (PANEL / 2);
        for (int k = 0; k < weights; k++)
            for (int j = 0; j < PANEL / 2; j++)
                row[k * (PANEL / 2) + j] = (uint8_t)(q[j][k] | q[j + PANEL / 2][k] << 4);
    } else {
        uint8_t *row = codes + (p * in_features + k0) * PANEL;
        for (int k = 0; k < weights; k++)
            for (int c = 0; c < PANEL; c++)
                row[k * PANEL + c] = (uint8_t)q[c][k];
    }
}

int pack_blocks(int kind, const uint8_t *blocks, const int64_t *rows, int64_t out_features,
                int64_t in_features, int layout, uint8_t *codes, float *scales, float *offsets,
                int num_threads) {
    int weights, bytes, group;
    shape_of(kind, &weights, &bytes, &group);
    if (!weights)
        return -1;
    const int64_t per_row = in_features / weights, groups = in_features / group, per_block = weights / group;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < out_features / PANEL; p++) {
        for (int64_t b = 0; b < per_row; b++) {
            int8_t q[PANEL][MAX_WEIGHTS];
            float scale[PANEL][MAX_GROUPS], offset[PANEL][MAX_GROUPS];
            for (int c = 0; c < PANEL; c++)
                decode(kind, blocks + (rows[p * PANEL + c] * per_row + b) * bytes, q[c], scale[c], offset[c]);
            for (int g = 0; g < per_block; g++)
                for (int c = 0; c < PANEL; c++) {
                    const int64_t at = (p * groups + b * per_block + g) * PANEL + c;
                    scales[at] = scale[c][g], offsets[at] = offset[c][g];
                }
            write_codes(q, weights, layout, p, b * weights, in_features, codes);
        }
    }
    return 0;
}
