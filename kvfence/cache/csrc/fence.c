/* The fence's batched validation (cache/fence.py) in one pass over a step's layout.
 *
 * Contract: the verdict of `Fence._numpy_verdict` for the same layout and pool, row by row (tested
 * against it on random layouts): reasons[r] is the first violation of row r in the order STALE_GENERATION,
 * FOREIGN_OWNER, UNWRITTEN_READ over every page it reads, then STALE_WRITE over every slot it writes; 0
 * for a clean row. A page id outside [0, num_pages) fails closed, as a foreign page. Returns how many
 * writes were refused (the pool counts them).
 */
#include <stdint.h>

enum { CLEAN = 0, STALE_GENERATION = 1, FOREIGN_OWNER = 2, UNWRITTEN_READ = 3, STALE_WRITE = 4 };

/* A row keeps its first reason in the order above, whichever page shows it. */
static void worst(int8_t *reason, int8_t found) {
    if (*reason == CLEAN || found < *reason) *reason = found;
}

int64_t validate_step(int64_t rows, const int64_t *starts, const int64_t *pages, const int64_t *generations,
                      const int64_t *tenants, const int64_t *num_cached, int64_t writes,
                      const int64_t *write_rows, const int64_t *write_pages, const int64_t *write_generations,
                      const int64_t *write_offsets, int64_t num_pages, int64_t page_size,
                      const int64_t *generation, const int64_t *owner, const int8_t *state,
                      const int64_t *written, const int64_t *holders, int8_t owned, int8_t *reasons) {
    for (int64_t r = 0; r < rows; r++) {
        reasons[r] = CLEAN;
        for (int64_t i = starts[r]; i < starts[r + 1]; i++) {
            const int64_t page = pages[i], logical = i - starts[r];
            if (page < 0 || page >= num_pages) {
                worst(reasons + r, FOREIGN_OWNER);
                continue;
            }
            int64_t required = num_cached[r] - logical * page_size;
            required = required < 0 ? 0 : required > page_size ? page_size : required;
            if (generation[page] != generations[i]) worst(reasons + r, STALE_GENERATION);
            if (owner[page] != tenants[r] || state[page] != owned) worst(reasons + r, FOREIGN_OWNER);
            if (written[page] < required) worst(reasons + r, UNWRITTEN_READ);
        }
    }
    int64_t refused = 0;
    for (int64_t w = 0; w < writes; w++) {
        const int64_t page = write_pages[w], r = write_rows[w];
        const int ok = page >= 0 && page < num_pages && generation[page] == write_generations[w] &&
                       owner[page] == tenants[r] && state[page] == owned && write_offsets[w] >= written[page] &&
                       holders[page] <= 1;
        if (!ok) {
            refused++;
            if (reasons[r] == CLEAN) reasons[r] = STALE_WRITE;
        }
    }
    return refused;
}
