/* ggml's 4-bit blocks (Q4_0, Q4_1) laid straight into packed_matmul.c's panels, once, at load.
 *
 * Why: the general path (packed_matmul.py's PackedWeight.pack over the codes gguf-py decodes) passes over
 * every weight about ten times in numpy and torch: 7 of the ~10 s the 1.07B Q4_0 file took to be served.
 * Here each block is read once and its 32 codes written where the kernel reads them.
 *
 * Contract: `blocks` holds a weight's rows of in_features / 32 blocks, each `block_bytes` long: float16 d,
 * for Q4_1 (`with_min`) float16 m, then 16 bytes, byte j holding weight j's code q in its low nibble and
 * weight j + 16's in its high one; w = q * d + m, Q4_0's m being -8 x d. Output feature n reads stored row
 * rows[n] (llama's Q/K rows are reordered). Writes panels [0, out_features / PANEL) in packed_matmul.c's
 * layout (the caller points at a part's first panel within a fused projection):
 *   codes    with `dot`: [panels, in / 8, 2, 64], byte 4j + i of line (t, h) holding column 16h + j's q
 *            for k = 8t + i low and k = 8t + 4 + i high; else [panels, in, PANEL / 2], byte j of row k
 *            holding column j's q low and column j + 16's high
 *   scales   [panels, in / 32, PANEL] float16: each block's d, its bits unchanged
 *   offsets  likewise each block's m (Q4_1); not written for Q4_0 (the kernel computes -8 x d)
 * That is, bit for bit, what PackedWeight.pack makes of the same weight whenever its codes span all 16
 * values (pack shifts codes by the least one present; every real weight has both 0 and 15). Every code
 * byte is written whole, so the output need not be cleared first.
 */
#include <stdint.h>
#include <string.h>

#define PANEL 32 /* as packed_matmul.c */
#define BLOCK 32 /* weights per ggml 4-bit block */

/* The 32 codes of each of a panel's columns in block g: q[column][weight within the block]. */
static void read_codes(const uint8_t *blocks, int64_t row_bytes, int64_t block_bytes, int with_min,
                       const int64_t *rows, int64_t g, uint8_t q[PANEL][BLOCK], uint16_t *scales,
                       uint16_t *offsets) {
    const int64_t codes_at = with_min ? 4 : 2;
    for (int c = 0; c < PANEL; c++) {
        const uint8_t *block = blocks + rows[c] * row_bytes + g * block_bytes;
        memcpy(&scales[c], block, 2);
        if (with_min)
            memcpy(&offsets[c], block + 2, 2);
        for (int j = 0; j < BLOCK / 2; j++) {
            q[c][j] = block[codes_at + j] & 15;
            q[c][j + BLOCK / 2] = block[codes_at + j] >> 4;
        }
    }
}

void pack_q4(const uint8_t *blocks, int64_t block_bytes, int with_min, const int64_t *rows,
             int64_t out_features, int64_t in_features, int dot, uint8_t *codes, uint16_t *scales,
             uint16_t *offsets, int num_threads) {
    const int64_t groups = in_features / BLOCK, row_bytes = groups * block_bytes;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < out_features / PANEL; p++) {
        for (int64_t g = 0; g < groups; g++) {
            uint8_t q[PANEL][BLOCK];
            const int64_t at = (p * groups + g) * PANEL;
            read_codes(blocks, row_bytes, block_bytes, with_min, rows + p * PANEL, g, q, scales + at,
                       offsets + (with_min ? at : 0));
            if (dot) {
                /* The block's four lines t = 4g .. 4g + 3, each two halves of 64 bytes. */
                uint8_t *lines = codes + (p * (in_features / 8) + g * 4) * 2 * 64;
                for (int t = 0; t < 4; t++)
                    for (int c = 0; c < PANEL; c++)
                        for (int i = 0; i < 4; i++)
                            lines[(t * 2 + c / 16) * 64 + 4 * (c % 16) + i] =
                                (uint8_t)(q[c][8 * t + i] | q[c][8 * t + 4 + i] << 4);
            } else {
                uint8_t *row = codes + (p * in_features + g * BLOCK) * (PANEL / 2);
                for (int k = 0; k < BLOCK; k++)
                    for (int j = 0; j < PANEL / 2; j++)
                        row[k * (PANEL / 2) + j] = (uint8_t)(q[j][k] | q[j + PANEL / 2][k] << 4);
            }
        }
    }
}
