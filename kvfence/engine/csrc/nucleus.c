/* The sampler's truncated draw (engine/sampler.py `draw`) for rows without a seed, one pass per row in C.
 *
 * Contract, per row r of `scaled` [rows, vocab] (temperature applied, min_p's drops at -inf):
 *   p = exp(scaled - max), over the finite entries;
 *   top_k[r] > 0 keeps the tokens whose p is at least the k-th largest p (ties at that edge all kept);
 *   top_p[r] < 1 then keeps, of those, the tokens whose p is at least the largest t such that the kept mass
 *   at or above t reaches top_p of the kept mass (ties at the edge all kept): the per-row definition (sort,
 *   keep while the mass before a token is under top_p), found without sorting;
 *   the token is the first in vocabulary order whose cumulative kept mass exceeds u[r] times the kept mass
 *   (inverse CDF: never a dropped token). tokens[r] = -1 where no logit is finite, or one is NaN or +inf
 *   (nothing sound to draw: the caller aborts that request alone).
 *   edges[r] = the least p kept, relative to the largest (for tests: the kept set is p >= edge * max).
 * Edges are found by a radix select over the float bits of p (ordered as the values, p >= 0): a histogram
 * of the high 16 bits, then of the low 16 bits within the edge's bin; masses summed in double.
 * Rows are independent (OpenMP over rows): a row's token depends on its own logits and u alone.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BINS 65536

static inline uint32_t bits_of(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

/* The largest 32-bit key t (over p >= floor) with weight(keys >= t) >= want, where the weight of a key is
 * `count ? 1 : p`; at least `floor`. Two histogram passes: high 16 bits, then low 16 within that bin. */
static uint32_t edge_key(const float *p, int64_t n, uint32_t floor, double want, int count, double *bins) {
    memset(bins, 0, sizeof(double) * BINS);
    for (int64_t i = 0; i < n; i++) {
        const uint32_t key = bits_of(p[i]);
        if (key >= floor) bins[key >> 16] += count ? 1.0 : (double)p[i];
    }
    double above = 0.0;
    int64_t high = BINS - 1;
    for (; high > 0; high--) {
        if (above + bins[high] >= want) break;
        above += bins[high];
    }
    memset(bins, 0, sizeof(double) * BINS);
    for (int64_t i = 0; i < n; i++) {
        const uint32_t key = bits_of(p[i]);
        if (key >= floor && (int64_t)(key >> 16) == high) bins[key & 0xFFFF] += count ? 1.0 : (double)p[i];
    }
    int64_t low = BINS - 1;
    for (; low > 0; low--) {
        if (above + bins[low] >= want) break;
        above += bins[low];
    }
    const uint32_t key = ((uint32_t)high << 16) | (uint32_t)low;
    return key > floor ? key : floor;
}

/* The mass of the tokens whose key is at least `floor`. */
static double mass_from(const float *p, int64_t n, uint32_t floor) {
    double mass = 0.0;
    for (int64_t i = 0; i < n; i++)
        if (bits_of(p[i]) >= floor) mass += p[i];
    return mass;
}

static int64_t draw_row(const float *scaled, int64_t vocab, int64_t top_k, double top_p, double u, float *p,
                        double *bins, float *edge) {
    float best = -INFINITY;
    for (int64_t i = 0; i < vocab; i++) {
        if (isnan(scaled[i]) || scaled[i] == INFINITY) return -1; /* no distribution: fail the row closed */
        if (scaled[i] > best) best = scaled[i];
    }
    if (!isfinite(best)) return -1;
    int64_t finite = 0;
    for (int64_t i = 0; i < vocab; i++) {
        p[i] = isfinite(scaled[i]) ? expf(scaled[i] - best) : 0.0f;
        finite += p[i] > 0.0f;
    }
    uint32_t floor = bits_of(0.0f) + 1; /* the least positive float: zeros are never kept */
    if (top_k > 0 && top_k < finite) floor = edge_key(p, vocab, floor, (double)top_k, 1, bins);
    double kept = mass_from(p, vocab, floor);
    if (top_p < 1.0) {
        floor = edge_key(p, vocab, floor, top_p * kept, 0, bins);
        kept = mass_from(p, vocab, floor);
    }
    float least;
    const uint32_t f = floor;
    memcpy(&least, &f, sizeof least);
    *edge = least;
    const double target = u * kept;
    double total = 0.0;
    int64_t last = -1;
    for (int64_t i = 0; i < vocab; i++) {
        if (bits_of(p[i]) < floor) continue;
        total += p[i];
        last = i;
        if (total > target) return i;
    }
    return last; /* rounding left the target at the very top: the last kept token */
}

int nucleus_draw(const float *scaled, int64_t rows, int64_t vocab, const int64_t *top_k, const double *top_p,
                 const double *u, int64_t *tokens, float *edges, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (rows > 1)
    {
        float *p = malloc(sizeof(float) * vocab);
        double *bins = malloc(sizeof(double) * BINS);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (p == NULL || bins == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            tokens[r] = draw_row(scaled + r * vocab, vocab, top_k[r], top_p[r], u[r], p, bins, edges + r);
        }
        free(p);
        free(bins);
    }
    return failed;
}
