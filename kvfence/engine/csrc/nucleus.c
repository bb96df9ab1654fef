/* The sampler's truncated draw (engine/sampler.py `draw`) for rows without a seed, a few passes a row in C.
 *
 * Contract, per row r of `weights` [rows, vocab]: exp(scaled - the row's max), computed by the caller (torch's
 * vectorised exp; a dropped token is 0), so every weight is in [0, 1];
 *   top_k[r] > 0 keeps the tokens whose weight is at least the k-th largest (ties at that edge all kept);
 *   top_p[r] < 1 then keeps, of those, the tokens whose weight is at least the largest t such that the kept
 *   mass at or above t reaches top_p of the kept mass (ties at the edge all kept): the per-row definition
 *   (sort, keep while the mass before a token is under top_p), found without sorting;
 *   the token is the first in vocabulary order whose cumulative kept mass exceeds u[r] times the kept mass
 *   (inverse CDF: never a dropped token). tokens[r] = -1 where no weight is positive, or one is outside
 *   [0, 1] (a NaN or an infinite logit: nothing sound to draw, the caller aborts that request alone).
 *   edges[r] = the least weight kept (for tests: the kept set is weight >= edge).
 * Edges are found by a radix select over the float bits of the weights (ordered as the values, w >= 0): the
 * check of the row makes histograms of the high 16 bits (w <= 1 bounds them; count and mass), an edge then
 * takes one pass to gather the tokens in its bin and histograms their next 8 and last 8 bits; the draw is
 * one more pass. Masses summed in double.
 * Rows are independent (OpenMP over rows): a row's token depends on its own weights and u alone.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ONE_KEY 0x3F800000u            /* the bits of 1.0f: no weight's key is larger */
#define HIGH_BINS ((ONE_KEY >> 16) + 1) /* bins of the high 16 bits, 0 .. 1.0f's */
#define BYTE_BINS 256

typedef struct {
    double *count, *mass; /* HIGH_BINS each: the positive weights by their high 16 bits */
    int32_t *in_bin;      /* vocab: the tokens of the edge's high bin */
} Scratch;

static inline uint32_t key_of(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

/* The highest bin b (at least 0) with above + weight(bins >= b) >= want; `above` gains the bins over it. */
static int64_t bin_reaching(const double *bins, int64_t n, double want, double *above) {
    int64_t b = n - 1;
    for (; b > 0; b--) {
        if (*above + bins[b] >= want) break;
        *above += bins[b];
    }
    return b;
}

/* The tokens whose key is at least `floor` and whose high 16 bits are `high`, into in_bin; how many. */
static int64_t gather(const float *w, int64_t n, uint32_t floor, uint32_t high, int32_t *in_bin) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t key = key_of(w[i]);
        if (key >= floor && key >> 16 == high) in_bin[m++] = (int32_t)i;
    }
    return m;
}

/* Within high bin `high` (its tokens in_bin, `above` the weight of the keys over it): the largest key t with
 * weight(keys >= t) >= want, where a key weighs `count ? 1 : w`; the next 8 bits, then the last 8. */
static uint32_t refine(const float *w, const int32_t *in_bin, int64_t m, uint32_t high, double want, int count,
                       double above) {
    uint32_t edge = high << 16;
    for (int shift = 8; shift >= 0; shift -= 8) {
        double bins[BYTE_BINS] = {0};
        for (int64_t j = 0; j < m; j++) {
            const uint32_t key = key_of(w[in_bin[j]]);
            if (key >> (shift + 8) == edge >> (shift + 8))
                bins[(key >> shift) & 0xFF] += count ? 1.0 : (double)w[in_bin[j]];
        }
        edge |= (uint32_t)bin_reaching(bins, BYTE_BINS, want, &above) << shift;
    }
    return edge;
}

/* The mass of high bin `high`'s tokens (in_bin) whose key is at least `floor`. */
static double mass_in_bin(const float *w, const int32_t *in_bin, int64_t m, uint32_t floor) {
    double mass = 0.0;
    for (int64_t j = 0; j < m; j++)
        if (key_of(w[in_bin[j]]) >= floor) mass += w[in_bin[j]];
    return mass;
}

/* The least key kept by keeping `want` of the weight over keys >= floor (`bins`: that weight by high bits),
 * at least `floor`; `kept` becomes the mass of the keys at or above it. Two passes over the row at most. */
static uint32_t edge_of(const float *w, int64_t n, uint32_t floor, double want, int count, double *bins,
                        Scratch *s, double *kept) {
    double above = 0.0;
    const uint32_t high = (uint32_t)bin_reaching(bins, HIGH_BINS, want, &above);
    const int64_t m = gather(w, n, floor, high, s->in_bin);
    const uint32_t edge = refine(w, s->in_bin, m, high, want, count, above), least = edge > floor ? edge : floor;
    double over = 0.0; /* the mass over the edge's high bin */
    for (int64_t b = high + 1; b < HIGH_BINS; b++) over += s->mass[b];
    s->mass[high] = mass_in_bin(w, s->in_bin, m, least); /* the mass histogram now counts kept keys alone */
    memset(s->mass, 0, sizeof(double) * high);
    *kept = over + s->mass[high];
    return least;
}

static int64_t draw_row(const float *w, int64_t vocab, int64_t top_k, double top_p, double u, Scratch *s,
                        float *edge) {
    memset(s->count, 0, sizeof(double) * HIGH_BINS);
    memset(s->mass, 0, sizeof(double) * HIGH_BINS);
    int64_t positive = 0;
    double kept = 0.0;
    for (int64_t i = 0; i < vocab; i++) {
        const uint32_t key = key_of(w[i]);
        if (key > ONE_KEY) return -1; /* NaN, negative (-0 too) or over 1: fail the row closed */
        if (key == 0) continue;       /* zeros are never kept */
        positive++;
        s->count[key >> 16] += 1.0;
        s->mass[key >> 16] += w[i];
        kept += w[i];
    }
    if (positive == 0) return -1;
    uint32_t floor = 1; /* the least positive float's key */
    if (top_k > 0 && top_k < positive) floor = edge_of(w, vocab, floor, (double)top_k, 1, s->count, s, &kept);
    if (top_p < 1.0) floor = edge_of(w, vocab, floor, top_p * kept, 0, s->mass, s, &kept);
    memcpy(edge, &floor, sizeof *edge);
    const double target = u * kept;
    double total = 0.0;
    int64_t last = -1;
    for (int64_t i = 0; i < vocab; i++) {
        if (key_of(w[i]) < floor) continue;
        total += w[i];
        last = i;
        if (total > target) return i;
    }
    return last; /* rounding left the target at the very top: the last kept token */
}

int nucleus_draw(const float *weights, int64_t rows, int64_t vocab, const int64_t *top_k, const double *top_p,
                 const double *u, int64_t *tokens, float *edges, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (rows > 1)
    {
        Scratch s = {malloc(sizeof(double) * HIGH_BINS), malloc(sizeof(double) * HIGH_BINS),
                     malloc(sizeof(int32_t) * vocab)};
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (s.count == NULL || s.mass == NULL || s.in_bin == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            tokens[r] = draw_row(weights + r * vocab, vocab, top_k[r], top_p[r], u[r], &s, edges + r);
        }
        free(s.count);
        free(s.mass);
        free(s.in_bin);
    }
    return failed;
}
