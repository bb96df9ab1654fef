/* The fence's batched validation (cache/fence.py) in one call over a step's layout: a Python extension
 * module, `kvfence_fence.validate(flat, rows, writes, pool, reasons) -> (bad rows, refused writes)`; and a
 * draft rollback, `kvfence_fence.take_back(pool, page, generation, tenant, start, end) -> bool`:
 * `KVPool.take_back`'s rule and effect (tested against it) on a pool in host memory.
 *
 * Contract: the verdict of `Fence._numpy_verdict` for the same layout and pool, row by row (tested
 * against it on random layouts): reasons[r] is the first violation of row r in the order STALE_GENERATION,
 * FOREIGN_OWNER, UNWRITTEN_READ over every page it reads, then STALE_WRITE over every slot it writes
 * (`KVPool.authorize_writes`' rule: granted, and at the page's next slot, no gap); 0 for a clean row. A
 * page id outside [0, num_pages) fails closed, as a foreign page. A layout whose offsets or write rows
 * point outside it is refused (ValueError) before anything is read.
 *
 * The layout is `StepLayout.flat`, one int64 array in the order of `struct layout` below; the pool is
 * `struct pool` at an address fixed when the fence is made (its arrays are allocated once and edited in
 * place). A module function, not ctypes: after a model step has flushed the caches, a ctypes call and an
 * array's `.ctypes.data` cost tens of microseconds each (measured), most of the check.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { CLEAN = 0, STALE_GENERATION = 1, FOREIGN_OWNER = 2, UNWRITTEN_READ = 3, STALE_WRITE = 4 };

struct pool {
    int64_t num_pages, page_size, owned;
    const int64_t *generation, *owner;
    const int8_t *state;
    int64_t *written; /* take_back moves it back; nothing else here writes it */
    const int64_t *holders;
    int64_t *next_slot; /* [num_pages] scratch of check_writes, the fence's own */
    /* The KV bytes, [blocks (layer, K or V), pages, slots, ...] `block_stride`, `page_stride` and
     * `slot_bytes` apart; NULL where the pool is not in host memory (take_back is not called then). */
    char *kv;
    int64_t blocks, block_stride, page_stride, slot_bytes;
};

struct layout {
    const int64_t *starts, *tenants, *num_cached;                            /* [rows + 1], [rows], [rows] */
    const int64_t *write_rows, *write_pages, *write_generations, *write_offsets; /* [writes] each */
    const int64_t *pages, *generations;                                      /* [starts[rows]] each */
};

static struct layout sections(const int64_t *flat, int64_t rows, int64_t writes) {
    struct layout l;
    l.starts = flat;
    l.tenants = l.starts + rows + 1;
    l.num_cached = l.tenants + rows;
    l.write_rows = l.num_cached + rows;
    l.write_pages = l.write_rows + writes;
    l.write_generations = l.write_pages + writes;
    l.write_offsets = l.write_generations + writes;
    l.pages = l.write_offsets + writes;
    l.generations = l.pages + l.starts[rows];
    return l;
}

/* A row keeps its first reason in the order above, whichever page shows it. */
static void worst(int8_t *reason, int8_t found) {
    if (*reason == CLEAN || found < *reason) *reason = found;
}

static void check_reads(const struct layout *l, int64_t rows, const struct pool *p, int8_t *reasons) {
    for (int64_t r = 0; r < rows; r++) {
        reasons[r] = CLEAN;
        for (int64_t i = l->starts[r]; i < l->starts[r + 1]; i++) {
            const int64_t page = l->pages[i], logical = i - l->starts[r];
            if (page < 0 || page >= p->num_pages) {
                worst(reasons + r, FOREIGN_OWNER);
                continue;
            }
            int64_t required = l->num_cached[r] - logical * p->page_size;
            required = required < 0 ? 0 : required > p->page_size ? p->page_size : required;
            if (p->generation[page] != l->generations[i]) worst(reasons + r, STALE_GENERATION);
            if (p->owner[page] != l->tenants[r] || p->state[page] != p->owned) worst(reasons + r, FOREIGN_OWNER);
            if (p->written[page] < required) worst(reasons + r, UNWRITTEN_READ);
        }
    }
}

/* Generation, owner, state and exclusivity: what a write needs before its slot is looked at. */
static int granted(const struct layout *l, int64_t w, const struct pool *p) {
    const int64_t page = l->write_pages[w];
    return page >= 0 && page < p->num_pages && p->generation[page] == l->write_generations[w] &&
           p->owner[page] == l->tenants[l->write_rows[w]] && p->state[page] == p->owned &&
           p->holders[page] <= 1;
}

/* The k-th granted write into a page (in layout order) must be at slot written + k: append-only and
 * without gaps. `next_slot` is scratch: each page written is set to its `written` first, so it needs no
 * clearing between calls. */
static int64_t check_writes(const struct layout *l, int64_t writes, const struct pool *p, int8_t *reasons) {
    for (int64_t w = 0; w < writes; w++)
        if (granted(l, w, p)) p->next_slot[l->write_pages[w]] = p->written[l->write_pages[w]];
    int64_t refused = 0;
    for (int64_t w = 0; w < writes; w++) {
        const int64_t r = l->write_rows[w];
        int ok = granted(l, w, p);
        if (ok) ok = l->write_offsets[w] == p->next_slot[l->write_pages[w]]++;
        if (!ok) {
            refused++;
            if (reasons[r] == CLEAN) reasons[r] = STALE_WRITE;
        }
    }
    return refused;
}

/* The layout's offsets and write rows stay inside it: nothing below reads past `length` int64s. */
static int well_formed(const int64_t *flat, Py_ssize_t length, int64_t rows, int64_t writes) {
    if (rows < 0 || writes < 0 || length < 3 * rows + 1 + 4 * writes) return 0;
    const struct layout l = sections(flat, rows, writes);
    if (l.starts[0] != 0 || length != 3 * rows + 1 + 4 * writes + 2 * l.starts[rows]) return 0;
    for (int64_t r = 0; r < rows; r++)
        if (l.starts[r + 1] < l.starts[r]) return 0;
    for (int64_t w = 0; w < writes; w++)
        if (l.write_rows[w] < 0 || l.write_rows[w] >= rows) return 0;
    return 1;
}

static int int64_buffer(PyObject *object, Py_buffer *view, int itemsize) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return 0;
    if (view->itemsize != itemsize) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "validate: wrong item size");
        return 0;
    }
    return 1;
}

static PyObject *validate(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "validate(flat, rows, writes, pool, reasons)");
        return NULL;
    }
    const int64_t rows = PyLong_AsLongLong(args[1]), writes = PyLong_AsLongLong(args[2]);
    const struct pool *pool = PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer flat, reasons;
    if (!int64_buffer(args[0], &flat, 8)) return NULL;
    if (!int64_buffer(args[4], &reasons, 1)) {
        PyBuffer_Release(&flat);
        return NULL;
    }
    PyObject *result = NULL;
    if (!well_formed(flat.buf, flat.len / 8, rows, writes) || reasons.len < rows) {
        PyErr_SetString(PyExc_ValueError, "validate: a malformed step layout");
    } else {
        const struct layout l = sections(flat.buf, rows, writes);
        int8_t *reason = reasons.buf;
        check_reads(&l, rows, pool, reason);
        const int64_t refused = check_writes(&l, writes, pool, reason);
        int64_t bad = 0;
        for (int64_t r = 0; r < rows; r++) bad += reason[r] != CLEAN;
        result = Py_BuildValue("(LL)", (long long)bad, (long long)refused);
    }
    PyBuffer_Release(&reasons);
    PyBuffer_Release(&flat);
    return result;
}

/* Slots [start, end) of `page` taken back for `tenant`, as `KVPool.take_back` does: allowed only for the
 * tenant holding the page alone at `generation`, for its written tail (written == end); then zeroed in
 * every block and `written` moved back to `start`. Why in C: after a forward pass the numpy checks and the
 * strided assignment took ~35 us a rollback, most of the fence's share of a speculative step. */
static PyObject *take_back(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "take_back(pool, page, generation, tenant, start, end)");
        return NULL;
    }
    struct pool *p = PyLong_AsVoidPtr(args[0]);
    const int64_t page = PyLong_AsLongLong(args[1]), generation = PyLong_AsLongLong(args[2]);
    const int64_t tenant = PyLong_AsLongLong(args[3]);
    const int64_t start = PyLong_AsLongLong(args[4]), end = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (p->kv == NULL) {
        PyErr_SetString(PyExc_ValueError, "take_back: the pool is not in host memory");
        return NULL;
    }
    const int allowed = page >= 0 && page < p->num_pages && 0 <= start && start < end &&
                        end <= p->page_size && p->generation[page] == generation && p->owner[page] == tenant &&
                        p->state[page] == p->owned && p->holders[page] <= 1 && p->written[page] == end;
    if (!allowed) Py_RETURN_FALSE;
    char *first = p->kv + page * p->page_stride + start * p->slot_bytes;
    const size_t run = (size_t)((end - start) * p->slot_bytes); /* the slots lie one after another */
    for (int64_t b = 0; b < p->blocks; b++) memset(first + b * p->block_stride, 0, run);
    p->written[page] = start;
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"validate", (PyCFunction)(void (*)(void))validate, METH_FASTCALL, "The step's verdict (see fence.c)."},
    {"take_back", (PyCFunction)(void (*)(void))take_back, METH_FASTCALL, "A draft rollback (see fence.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvfence_fence", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvfence_fence(void) { return PyModule_Create(&module); }
