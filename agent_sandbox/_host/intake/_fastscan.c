/* The host's native decoding helpers: a pickle prescan for plain-data streams, a strict
 * base64 decoder for canonical input, and a decoder for a pickle that is one bytes value.
 *
 * All only ever say "yes, and here is the answer" or "not sure": `prescan_data` returns True
 * when a stream holds plain data only (no globals, so nothing is called while building) and
 * passes every check and budget of the Python prescan
 * (`agent_sandbox._host.intake.unpickle_prescan._Scan`), and False for anything else, hostile
 * or merely unusual; `b64decode` returns None for anything that is not canonical base64;
 * `decode_blob` returns the value of base64 text whose pickle is exactly one bytes or
 * bytearray value (PROTO, an optional FRAME, the bytes opcode, an optional MEMOIZE, STOP)
 * within the budgets, decoded from the text straight into the value, and None for anything
 * else. On "not sure" the caller runs its Python path, which decides and words the refusal.
 * So this file can only be stricter than the Python code, never looser:
 * tests/host/intake/test_fastscan.py checks that on valid, mutated and crafted streams and
 * texts, with the AVX2 base64 loop on and off.
 *
 * The prescan mirrors `_Scan.run` for the opcodes of plain data: scalars, strings, bytes,
 * containers, MARK/POP, FRAME and the memo (MEMOIZE, BINGET, LONG_BINGET). A stack slot is a
 * pointer to a value record, so a memoized value fetched again is the same record (its depth
 * and its hash counts are shared, as the Python scan shares its `_Val` objects). Keys counted
 * for hash flooding: ints (the numeric hash, |n| mod 2**61-1 with the sign), floats (but not
 * NaN, whose hash is per object) and bools; a tuple key, an int wider than 64 bits or a NaN key
 * makes the answer "not sure".
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define B64_X86 1
#include <immintrin.h>
#else
#define B64_X86 0
#endif

enum {
    K_NONE, K_BOOL, K_INT, K_FLOAT, K_STR, K_BYTES, K_BYTEARRAY,
    K_LIST, K_DICT, K_SET, K_FROZENSET, K_TUPLE,
};

typedef struct Counts {
    Py_hash_t *keys;
    int32_t *counts;
    uint8_t *used;
    size_t cap;
    size_t len;
    struct Counts *next; /* every table, for freeing */
} Counts;

typedef struct Val {
    uint8_t kind;
    uint8_t exact; /* K_INT: `i` holds the value (it fits in 64 bits) */
    int64_t depth;
    union {
        int64_t i;
        double d;
    } v;
    Counts *hashes;
} Val;

#define CHUNK 4096

typedef struct Chunk {
    struct Chunk *next;
    size_t used;
    Val vals[CHUNK];
} Chunk;

typedef struct {
    Chunk *chunks;
    Counts *tables;
    Val **stack;
    size_t sp, stack_cap;
    size_t *marks;
    size_t nmarks, marks_cap;
    Val **memo;
    size_t memo_len, memo_cap;
    int64_t max_depth, max_memo, max_int_bytes, max_same_hash;
} Scan;

static Val *
new_val(Scan *s, int kind)
{
    if (s->chunks == NULL || s->chunks->used == CHUNK) {
        Chunk *c = PyMem_Malloc(sizeof(Chunk));
        if (c == NULL) {
            return NULL;
        }
        c->next = s->chunks;
        c->used = 0;
        s->chunks = c;
    }
    Val *v = &s->chunks->vals[s->chunks->used++];
    v->kind = (uint8_t)kind;
    v->exact = 0;
    v->depth = 0;
    v->v.i = 0;
    v->hashes = NULL;
    return v;
}

static int
grow_ptrs(void ***arr, size_t *cap, size_t need, size_t size)
{
    if (need <= *cap) {
        return 0;
    }
    size_t n = *cap ? *cap * 2 : 256;
    while (n < need) {
        n *= 2;
    }
    void *p = PyMem_Realloc(*arr, n * size);
    if (p == NULL) {
        return -1;
    }
    *arr = p;
    *cap = n;
    return 0;
}

static int
push(Scan *s, Val *v)
{
    if (grow_ptrs((void ***)&s->stack, &s->stack_cap, s->sp + 1, sizeof(Val *)) < 0) {
        return -1;
    }
    s->stack[s->sp++] = v;
    return 0;
}

/* The start of the current segment (the stack above the last MARK). */
static size_t
base(Scan *s)
{
    return s->nmarks ? s->marks[s->nmarks - 1] : 0;
}

/* Raise target's depth to cover items; -1 when it goes over the budget. */
static int
grow(Scan *s, Val *target, Val **items, size_t n)
{
    if (n) {
        int64_t deepest = 0;
        for (size_t i = 0; i < n; i++) {
            if (items[i]->depth > deepest) {
                deepest = items[i]->depth;
            }
        }
        deepest += 1;
        if (deepest > target->depth) {
            target->depth = deepest;
        }
    }
    return target->depth > s->max_depth ? -1 : 0;
}

static Py_hash_t
int_hash(int64_t value)
{
    const uint64_t P = ((uint64_t)1 << 61) - 1; /* sys.hash_info.modulus on 64-bit builds */
    uint64_t a = value < 0 ? (uint64_t)0 - (uint64_t)value : (uint64_t)value;
    int64_t h = (int64_t)(a % P);
    if (value < 0) {
        h = -h;
    }
    return h == -1 ? -2 : (Py_hash_t)h;
}

/* The hashes counted here are attacker-chosen, so the slot they start probing at comes from
 * a keyed mix whose two keys are drawn from os.urandom when the module loads (a public
 * scramble lets a worker pick keys that all land in one slot and make every insertion walk
 * the whole table). However the keys fall, a probe run longer than MAX_PROBE makes the
 * answer "not sure" and the Python prescan decides, so an insertion costs at most
 * MAX_PROBE probes. */
static uint64_t slot_key0, slot_key1;
static uint64_t probe_steps; /* every probe step ever taken (`probes()`, for the tests) */
#define MAX_PROBE 64

static uint64_t
fmix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}

static size_t
slot(Py_hash_t h, size_t cap)
{
    uint64_t x = fmix64(fmix64((uint64_t)h ^ slot_key0) ^ slot_key1);
    return (size_t)x & (cap - 1);
}

/* Count one more key with hash h in target's table; -1 over the budget or on failure, -2
 * on a probe run longer than MAX_PROBE (all three mean "not sure"). */
static int
count_hash(Scan *s, Val *target, Py_hash_t h)
{
    Counts *t = target->hashes;
    if (t == NULL) {
        t = PyMem_Calloc(1, sizeof(Counts));
        if (t == NULL) {
            return -1;
        }
        t->next = s->tables;
        s->tables = t;
        target->hashes = t;
    }
    if ((t->len + 1) * 2 > t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        Py_hash_t *keys = PyMem_Calloc(cap, sizeof(Py_hash_t));
        int32_t *counts = PyMem_Calloc(cap, sizeof(int32_t));
        uint8_t *used = PyMem_Calloc(cap, 1);
        if (keys == NULL || counts == NULL || used == NULL) {
            PyMem_Free(keys);
            PyMem_Free(counts);
            PyMem_Free(used);
            return -1;
        }
        for (size_t i = 0; i < t->cap; i++) {
            if (t->used[i]) {
                size_t j = slot(t->keys[i], cap);
                size_t probes = 0;
                while (used[j]) {
                    j = (j + 1) & (cap - 1);
                    probe_steps++;
                    if (++probes > MAX_PROBE) {
                        PyMem_Free(keys);
                        PyMem_Free(counts);
                        PyMem_Free(used);
                        return -2;
                    }
                }
                used[j] = 1;
                keys[j] = t->keys[i];
                counts[j] = t->counts[i];
            }
        }
        PyMem_Free(t->keys);
        PyMem_Free(t->counts);
        PyMem_Free(t->used);
        t->keys = keys;
        t->counts = counts;
        t->used = used;
        t->cap = cap;
    }
    size_t j = slot(h, t->cap);
    size_t probes = 0;
    while (t->used[j] && t->keys[j] != h) {
        j = (j + 1) & (t->cap - 1);
        probe_steps++;
        if (++probes > MAX_PROBE) {
            return -2; /* a long probe run: not sure */
        }
    }
    if (!t->used[j]) {
        t->used[j] = 1;
        t->keys[j] = h;
        t->counts[j] = 0;
        t->len++;
    }
    t->counts[j] += 1;
    return t->counts[j] > s->max_same_hash ? -1 : 0;
}

/* Mirror of `_Scan.count_hashes`; -1 for "not sure" (or over the budget). */
static int
count_hashes(Scan *s, Val *target, Val **keys, size_t n, size_t step)
{
    for (size_t i = 0; i < n; i += step) {
        Val *k = keys[i];
        Py_hash_t h;
        switch (k->kind) {
        case K_INT:
            if (!k->exact) {
                return -1;
            }
            h = int_hash(k->v.i);
            break;
        case K_BOOL:
            h = (Py_hash_t)k->v.i;
            break;
        case K_FLOAT: {
            if (Py_IS_NAN(k->v.d)) {
                return -1;
            }
            PyObject *f = PyFloat_FromDouble(k->v.d);
            if (f == NULL) {
                return -1;
            }
            h = PyObject_Hash(f);
            Py_DECREF(f);
            if (h == -1) {
                return -1;
            }
            break;
        }
        case K_TUPLE:
            return -1;
        default:
            continue; /* str and bytes hashes are salted per process */
        }
        if (count_hash(s, target, h) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Valid UTF-8 without surrogates (what strict `decode("utf-8")` accepts): a string that
   is not text is left to the Python scan, which refuses it. */
static int
utf8_ok(const unsigned char *p, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned char c = p[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t extra;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) {
            extra = 1;
        }
        else if (c == 0xE0) {
            extra = 2;
            lo = 0xA0;
        }
        else if (c == 0xED) {
            extra = 2;
            hi = 0x9F; /* 0xED 0xA0..0xBF: a surrogate */
        }
        else if (c >= 0xE1 && c <= 0xEF) {
            extra = 2;
        }
        else if (c == 0xF0) {
            extra = 3;
            lo = 0x90;
        }
        else if (c >= 0xF1 && c <= 0xF3) {
            extra = 3;
        }
        else if (c == 0xF4) {
            extra = 3;
            hi = 0x8F;
        }
        else {
            return 0;
        }
        if (n - i <= extra) {
            return 0;
        }
        if (p[i + 1] < lo || p[i + 1] > hi) {
            return 0;
        }
        for (size_t k = 2; k <= extra; k++) {
            if (p[i + k] < 0x80 || p[i + k] > 0xBF) {
                return 0;
            }
        }
        i += extra + 1;
    }
    return 1;
}

static uint64_t
le(const unsigned char *p, size_t width)
{
    uint64_t v = 0;
    for (size_t i = 0; i < width; i++) {
        v |= (uint64_t)p[i] << (8 * i);
    }
    return v;
}

/* A length field of `width` bytes at *pos, then that many bytes: 0 and *size when they fit. */
static int
length(const unsigned char *d, size_t n, size_t *pos, size_t width, int is_signed, size_t *size)
{
    if (n - *pos < width) {
        return -1;
    }
    uint64_t raw = le(d + *pos, width);
    *pos += width;
    if (is_signed && width == 4 && (raw & 0x80000000u)) {
        return -1; /* negative */
    }
    if (raw > (uint64_t)(n - *pos)) {
        return -1;
    }
    *size = (size_t)raw;
    return 0;
}

/* 1: accepted; 0: not sure; -1: an exception is set (memory). */
static int
run(Scan *s, const unsigned char *d, size_t n, int64_t max_opcodes)
{
    size_t pos = 2;
    int64_t ops = 0;
    Val *v;
    /* The end of the current FRAME (0 outside one): as in the Python scan, an opcode that
     * crosses a frame's end and a FRAME inside a frame are refused (one reading of the
     * bytes: a file-fed unpickler reads them differently from a linear one). */
    size_t frame_end = 0;
    for (;;) {
        if (frame_end) {
            if (pos == frame_end) {
                frame_end = 0;
            }
            else if (pos > frame_end) {
                return 0;
            }
        }
        if (pos >= n) {
            return 0;
        }
        if (++ops > max_opcodes) {
            return 0;
        }
        unsigned char op = d[pos++];
        size_t size, width;
        switch (op) {
        case 0x8C: /* SHORT_BINUNICODE */
            if (pos >= n) {
                return 0;
            }
            size = d[pos];
            if (size > n - pos - 1) {
                return 0;
            }
            if (!utf8_ok(d + pos + 1, size)) {
                return 0;
            }
            pos += 1 + size;
            if ((v = new_val(s, K_STR)) == NULL || push(s, v) < 0) {
                return -1;
            }
            break;
        case 0x94: /* MEMOIZE */
            if ((int64_t)s->memo_len >= s->max_memo || s->sp == base(s)) {
                return 0;
            }
            if (grow_ptrs((void ***)&s->memo, &s->memo_cap, s->memo_len + 1, sizeof(Val *)) < 0) {
                return -1;
            }
            s->memo[s->memo_len++] = s->stack[s->sp - 1];
            break;
        case 0x47: /* BINFLOAT */
            if (n - pos < 8) {
                return 0;
            }
            if ((v = new_val(s, K_FLOAT)) == NULL) {
                return -1;
            }
            v->v.d = PyFloat_Unpack8((const char *)d + pos, 0);
            if (v->v.d == -1.0 && PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
            pos += 8;
            if (push(s, v) < 0) {
                return -1;
            }
            break;
        case 0x2E: /* STOP */
            return (s->nmarks == 0 && s->sp == 1 && pos == n) ? 1 : 0;
        case 0x95: /* FRAME */
            if (frame_end || n - pos < 8) {
                return 0;
            }
            if (le(d + pos, 8) > (uint64_t)(n - pos - 8)) {
                return 0;
            }
            pos += 8;
            frame_end = pos + (size_t)le(d + pos - 8, 8);
            break;
        case 0x58: /* BINUNICODE */
        case 0x8D: /* BINUNICODE8 */
            if (length(d, n, &pos, op == 0x58 ? 4 : 8, 0, &size) < 0) {
                return 0;
            }
            if (!utf8_ok(d + pos, size)) {
                return 0;
            }
            pos += size;
            if ((v = new_val(s, K_STR)) == NULL || push(s, v) < 0) {
                return -1;
            }
            break;
        case 0x68: /* BINGET */
        case 0x6A: /* LONG_BINGET */ {
            width = op == 0x68 ? 1 : 4;
            if (n - pos < width) {
                return 0;
            }
            uint64_t idx = le(d + pos, width);
            pos += width;
            if (idx >= s->memo_len) {
                return 0;
            }
            v = s->memo[idx];
            if (v->depth > s->max_depth) {
                return 0;
            }
            if (push(s, v) < 0) {
                return -1;
            }
            break;
        }
        case 0x4B: /* BININT1 */
        case 0x4D: /* BININT2 */
        case 0x4A: /* BININT */ {
            width = op == 0x4B ? 1 : op == 0x4D ? 2 : 4;
            if (n - pos < width) {
                return 0;
            }
            uint64_t raw = le(d + pos, width);
            pos += width;
            if ((v = new_val(s, K_INT)) == NULL) {
                return -1;
            }
            v->exact = 1;
            v->v.i = op == 0x4A ? (int64_t)(int32_t)(uint32_t)raw : (int64_t)raw;
            if (push(s, v) < 0) {
                return -1;
            }
            break;
        }
        case 0x8A: /* LONG1 */
        case 0x8B: /* LONG4 */
            if (length(d, n, &pos, op == 0x8A ? 1 : 4, op == 0x8B, &size) < 0) {
                return 0;
            }
            if ((int64_t)size > s->max_int_bytes) {
                return 0;
            }
            if ((v = new_val(s, K_INT)) == NULL) {
                return -1;
            }
            if (size <= 8) {
                uint64_t raw = le(d + pos, size);
                if (size > 0 && size < 8 && (raw >> (8 * size - 1)) & 1) {
                    raw |= ~(uint64_t)0 << (8 * size); /* sign-extend */
                }
                v->v.i = (int64_t)raw;
                v->exact = 1;
            }
            pos += size;
            if (push(s, v) < 0) {
                return -1;
            }
            break;
        case 0x43: /* SHORT_BINBYTES */
        case 0x42: /* BINBYTES */
        case 0x8E: /* BINBYTES8 */
        case 0x96: /* BYTEARRAY8 */
            width = op == 0x43 ? 1 : op == 0x42 ? 4 : 8;
            if (length(d, n, &pos, width, 0, &size) < 0) {
                return 0;
            }
            pos += size;
            if ((v = new_val(s, op == 0x96 ? K_BYTEARRAY : K_BYTES)) == NULL || push(s, v) < 0) {
                return -1;
            }
            break;
        case 0x28: /* MARK */
            if ((int64_t)s->nmarks >= s->max_depth) {
                return 0;
            }
            if (grow_ptrs((void ***)&s->marks, &s->marks_cap, s->nmarks + 1, sizeof(size_t)) < 0) {
                return -1;
            }
            s->marks[s->nmarks++] = s->sp;
            break;
        case 0x4E: /* NONE */
        case 0x88: /* NEWTRUE */
        case 0x89: /* NEWFALSE */
            if ((v = new_val(s, op == 0x4E ? K_NONE : K_BOOL)) == NULL) {
                return -1;
            }
            v->v.i = op == 0x88;
            if (push(s, v) < 0) {
                return -1;
            }
            break;
        case 0x5D: /* EMPTY_LIST */
        case 0x7D: /* EMPTY_DICT */
        case 0x8F: /* EMPTY_SET */
        case 0x29: /* EMPTY_TUPLE */ {
            int kind = op == 0x5D ? K_LIST : op == 0x7D ? K_DICT : op == 0x8F ? K_SET : K_TUPLE;
            if ((v = new_val(s, kind)) == NULL || push(s, v) < 0) {
                return -1;
            }
            break;
        }
        case 0x61: /* APPEND */
        case 0x73: /* SETITEM */ {
            size_t count = op == 0x61 ? 1 : 2;
            if (s->sp - base(s) < count + 1) {
                return 0; /* the items, then the target below them */
            }
            s->sp -= count;
            Val **items = s->stack + s->sp;
            Val *target = s->stack[s->sp - 1];
            if (target->kind != (op == 0x61 ? K_LIST : K_DICT)) {
                return 0;
            }
            if (op == 0x73 && count_hashes(s, target, items, 1, 1) < 0) {
                return PyErr_Occurred() ? -1 : 0;
            }
            if (grow(s, target, items, count) < 0) {
                return 0;
            }
            break;
        }
        case 0x65: /* APPENDS */
        case 0x75: /* SETITEMS */
        case 0x90: /* ADDITEMS */ {
            if (s->nmarks == 0) {
                return 0;
            }
            size_t mark = s->marks[--s->nmarks];
            Val **items = s->stack + mark;
            size_t count = s->sp - mark;
            s->sp = mark;
            if (s->sp == base(s)) {
                return 0;
            }
            Val *target = s->stack[s->sp - 1];
            int want = op == 0x65 ? K_LIST : op == 0x75 ? K_DICT : K_SET;
            if (target->kind != want || (op == 0x75 && count % 2)) {
                return 0;
            }
            if (op != 0x65 && count_hashes(s, target, items, count, op == 0x75 ? 2 : 1) < 0) {
                return PyErr_Occurred() ? -1 : 0;
            }
            if (grow(s, target, items, count) < 0) {
                return 0;
            }
            break;
        }
        case 0x91: /* FROZENSET */
        case 0x74: /* TUPLE */
        case 0x85: /* TUPLE1 */
        case 0x86: /* TUPLE2 */
        case 0x87: /* TUPLE3 */ {
            size_t start;
            if (op == 0x91 || op == 0x74) {
                if (s->nmarks == 0) {
                    return 0;
                }
                start = s->marks[--s->nmarks];
            }
            else {
                size_t count = (size_t)(op - 0x84);
                if (s->sp - base(s) < count) {
                    return 0;
                }
                start = s->sp - count;
            }
            Val **items = s->stack + start;
            size_t count = s->sp - start;
            if ((v = new_val(s, op == 0x91 ? K_FROZENSET : K_TUPLE)) == NULL) {
                return -1;
            }
            if (op == 0x91 && count_hashes(s, v, items, count, 1) < 0) {
                return PyErr_Occurred() ? -1 : 0;
            }
            if (grow(s, v, items, count) < 0) {
                return 0;
            }
            s->sp = start;
            if (push(s, v) < 0) {
                return -1;
            }
            break;
        }
        case 0x30: /* POP */
            if (s->sp > base(s)) {
                s->sp--;
            }
            else if (s->nmarks) {
                s->nmarks--; /* POP of an empty segment drops its MARK */
            }
            else {
                return 0;
            }
            break;
        case 0x31: /* POP_MARK */
            if (s->nmarks == 0) {
                return 0;
            }
            s->sp = s->marks[--s->nmarks];
            break;
        default:
            return 0; /* globals, calls, BUILD and everything outside the allowed families */
        }
    }
}

static int64_t
budget(PyObject *value)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow > 0) {
        return INT64_MAX / 4;
    }
    if (overflow < 0 || (v == -1 && PyErr_Occurred())) {
        return -1;
    }
    return (int64_t)v;
}

PyDoc_STRVAR(prescan_data_doc,
"prescan_data(data, max_bytes, max_opcodes, max_depth, max_memo, max_int_bytes,\n"
"             max_same_hash, /)\n--\n\n"
"True when `data` is a protocol 4/5 pickle of plain data that the Python prescan accepts\n"
"with these budgets; False when not sure (run the Python prescan).");

static PyObject *
prescan_data(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "prescan_data takes 7 arguments");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    int64_t b[6];
    for (int i = 0; i < 6; i++) {
        if (!PyLong_Check(args[i + 1])) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "the budgets must be ints");
            return NULL;
        }
        b[i] = budget(args[i + 1]);
        if (PyErr_Occurred()) {
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    const unsigned char *d = view.buf;
    size_t n = (size_t)view.len;
    int answer = 0;
    Scan s;
    memset(&s, 0, sizeof(s));
    s.max_depth = b[2];
    s.max_memo = b[3];
    s.max_int_bytes = b[4];
    s.max_same_hash = b[5];
    int budgets_ok = b[0] >= 0 && b[1] >= 0 && b[2] >= 0 && b[3] >= 0 && b[4] >= 0 && b[5] >= 0;
    if (budgets_ok && (int64_t)n <= b[0] && n >= 3 && d[0] == 0x80 && (d[1] == 4 || d[1] == 5)) {
        answer = run(&s, d, n, b[1]);
    }
    while (s.chunks) {
        Chunk *next = s.chunks->next;
        PyMem_Free(s.chunks);
        s.chunks = next;
    }
    while (s.tables) {
        Counts *next = s.tables->next;
        PyMem_Free(s.tables->keys);
        PyMem_Free(s.tables->counts);
        PyMem_Free(s.tables->used);
        PyMem_Free(s.tables);
        s.tables = next;
    }
    PyMem_Free(s.stack);
    PyMem_Free(s.marks);
    PyMem_Free(s.memo);
    PyBuffer_Release(&view);
    if (answer < 0) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        return NULL;
    }
    return PyBool_FromLong(answer == 1);
}

/* -- base64 ----------------------------------------------------------------------------
 *
 * Canonical base64 only: the alphabet A-Z a-z 0-9 + /, a length that is a multiple of 4, at
 * most two '=' and only at the very end, zero padding bits. Anything else returns None and
 * the caller's strict `binascii` decides. The bulk of the text is decoded 32 characters at
 * a time with AVX2 when the CPU has it (checked once at import), else 4 at a time through
 * four tables; both stop at the first character outside the alphabet and the text is then
 * refused. The last quad (the only one that may hold '=') is always decoded by the scalar
 * code. Every read is inside the text and every write inside the output object: the vector
 * loop runs only while 32 characters remain before the last quad and 32 bytes remain in the
 * output (it writes 32 and keeps 24).
 */

/* d0..d3[c]: the 6-bit value of c shifted into place in a 24-bit group, or B64_BAD. */
#define B64_BAD 0x01000000u
static uint32_t b64_d0[256], b64_d1[256], b64_d2[256], b64_d3[256];
static signed char b64_table[256];
static int b64_have_avx2; /* the CPU has AVX2 */
static int b64_use_avx2;  /* and the vector loop is on (`vector()`, for the tests) */

static void
b64_init(void)
{
    const char *alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    memset(b64_table, -1, sizeof(b64_table));
    for (int i = 0; i < 256; i++) {
        b64_d0[i] = b64_d1[i] = b64_d2[i] = b64_d3[i] = B64_BAD;
    }
    for (int i = 0; i < 64; i++) {
        unsigned char c = (unsigned char)alphabet[i];
        b64_table[c] = (signed char)i;
        b64_d0[c] = (uint32_t)i << 18;
        b64_d1[c] = (uint32_t)i << 12;
        b64_d2[c] = (uint32_t)i << 6;
        b64_d3[c] = (uint32_t)i;
    }
#if B64_X86
    __builtin_cpu_init();
    b64_have_avx2 = __builtin_cpu_supports("avx2");
#endif
    b64_use_avx2 = b64_have_avx2;
}

/* Decode `quads` full quads (no '=') from p into o; 0, or -1 at a character outside the
 * alphabet. */
static int
b64_scalar(const unsigned char *p, size_t quads, unsigned char *o)
{
    for (size_t q = 0; q < quads; q++, p += 4, o += 3) {
        uint32_t w = b64_d0[p[0]] | b64_d1[p[1]] | b64_d2[p[2]] | b64_d3[p[3]];
        if (w & B64_BAD) {
            return -1;
        }
        o[0] = (unsigned char)(w >> 16);
        o[1] = (unsigned char)(w >> 8);
        o[2] = (unsigned char)w;
    }
    return 0;
}

#if B64_X86
/* Decode 32-character blocks while `blocks` remain; returns how many were decoded (it stops
 * early at a block holding a character outside the alphabet). Each block writes 32 bytes at
 * o (24 meaningful): the caller leaves 8 bytes of room past the last block's 24. */
__attribute__((target("avx2"))) static size_t
b64_avx2(const unsigned char *p, size_t blocks, unsigned char *o)
{
    /* Per low nibble / high nibble: bit sets whose AND is non-zero exactly for characters
     * outside the alphabet. */
    const __m256i lut_lo = _mm256_setr_epi8(
        0x15, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x13, 0x1A, 0x1B, 0x1B, 0x1B,
        0x1A, 0x15, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x13, 0x1A, 0x1B, 0x1B,
        0x1B, 0x1A);
    const __m256i lut_hi = _mm256_setr_epi8(
        0x10, 0x10, 0x01, 0x02, 0x04, 0x08, 0x04, 0x08, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10,
        0x10, 0x10, 0x10, 0x01, 0x02, 0x04, 0x08, 0x04, 0x08, 0x10, 0x10, 0x10, 0x10, 0x10, 0x10,
        0x10, 0x10);
    /* What to add to a character to get its value, by high nibble ('/' is index 1). */
    const __m256i lut_roll = _mm256_setr_epi8(
        0, 16, 19, 4, -65, -65, -71, -71, 0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 19, 4, -65, -65, -71,
        -71, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m256i mask_2f = _mm256_set1_epi8(0x2F);
    const __m256i merge1 = _mm256_set1_epi32(0x01400140);
    const __m256i merge2 = _mm256_set1_epi32(0x00011000);
    const __m256i pack = _mm256_setr_epi8(
        2, 1, 0, 6, 5, 4, 10, 9, 8, 14, 13, 12, -1, -1, -1, -1, 2, 1, 0, 6, 5, 4, 10, 9, 8, 14,
        13, 12, -1, -1, -1, -1);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 7, 7);
    size_t done = 0;
    for (; done < blocks; done++, p += 32, o += 24) {
        __m256i in = _mm256_loadu_si256((const __m256i *)p);
        __m256i hi_nib = _mm256_and_si256(_mm256_srli_epi32(in, 4), mask_2f);
        __m256i lo_nib = _mm256_and_si256(in, mask_2f);
        __m256i hi = _mm256_shuffle_epi8(lut_hi, hi_nib);
        __m256i lo = _mm256_shuffle_epi8(lut_lo, lo_nib);
        if (!_mm256_testz_si256(lo, hi)) {
            break;
        }
        __m256i eq_2f = _mm256_cmpeq_epi8(in, mask_2f);
        __m256i roll = _mm256_shuffle_epi8(lut_roll, _mm256_add_epi8(eq_2f, hi_nib));
        __m256i vals = _mm256_add_epi8(in, roll);
        __m256i ab = _mm256_maddubs_epi16(vals, merge1);
        __m256i abc = _mm256_madd_epi16(ab, merge2);
        __m256i out = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(abc, pack), lanes);
        _mm256_storeu_si256((__m256i *)o, out);
    }
    return done;
}
#endif

/* Decode quad qi of canonical text of n characters (pad '=' at its end) into out[0..3):
 * the number of bytes it holds (3, or 3 - pad for the last quad), or -1 when it is not
 * canonical. */
static int
b64_quad(const unsigned char *p, size_t n, size_t pad, size_t qi, unsigned char *out)
{
    const unsigned char *t = p + qi * 4;
    if (qi + 1 < n / 4 || pad == 0) {
        return b64_scalar(t, 1, out) < 0 ? -1 : 3;
    }
    int a = b64_table[t[0]], b = b64_table[t[1]];
    int c = pad == 2 ? 0 : b64_table[t[2]];
    if ((a | b | c) < 0 || (pad == 2 && (b & 0x0F)) || (pad == 1 && (c & 0x03))) {
        return -1;
    }
    uint32_t w = ((uint32_t)a << 18) | ((uint32_t)b << 12) | ((uint32_t)c << 6);
    out[0] = (unsigned char)(w >> 16);
    if (pad == 1) {
        out[1] = (unsigned char)(w >> 8);
    }
    return (int)(3 - pad);
}

/* Decode canonical base64 of n characters into o (exactly n / 4 * 3 - pad bytes, computed by
 * the caller with b64_out_len); 0, or -1 when the text is not canonical. */
static int
b64_into(const unsigned char *p, size_t n, unsigned char *o, size_t pad)
{
    size_t quads = n / 4 - 1; /* every quad but the last, which may hold '=' */
    size_t q = 0;
#if B64_X86
    if (b64_use_avx2 && quads >= 8) {
        /* Block k reads quads [8k, 8k + 8) and writes 32 bytes from 24k: it needs quads
         * 8k + 8 <= quads and 24k + 32 <= the output, which holds 3 * quads + 1 or more. */
        size_t blocks = (quads - 8) / 8 + 1;
        if (blocks * 24 + 8 > quads * 3) {
            blocks--;
        }
        q = b64_avx2(p, blocks, o) * 8;
    }
#endif
    if (b64_scalar(p + q * 4, quads - q, o + q * 3) < 0) {
        return -1;
    }
    return b64_quad(p, n, pad, quads, o + quads * 3) < 0 ? -1 : 0;
}

/* The padding of canonical text of n > 0 characters (n a multiple of 4): 0, 1 or 2. */
static size_t
b64_pad(const unsigned char *p, size_t n)
{
    if (p[n - 1] != '=') {
        return 0;
    }
    return p[n - 2] == '=' ? 2 : 1;
}

/* Decode bytes [a, b) of the decoded text into dst[0 .. b - a) (the caller checked that
 * b <= the decoded length); 0, or -1 when a quad it reads is not canonical. The quads wholly
 * inside the range (but the last quad of the text) are decoded in place, with AVX2 where the
 * range leaves the vector loop its 8 bytes of slack; the partial ones through a 3-byte
 * buffer. */
static int
b64_range(const unsigned char *p, size_t n, size_t pad, size_t a, size_t b, unsigned char *dst)
{
    size_t last = n / 4 - 1;
    size_t q = a / 3;
    unsigned char tmp[3];
    if (a >= b) {
        return 0;
    }
    while (q * 3 < b) {
        size_t lo = q * 3, hi = lo + 3;
        if (lo >= a && hi <= b && q < last) {
            /* whole quads from q up to (not including) the last quad or the range's end */
            size_t count = (b - lo) / 3;
            if (count > last - q) {
                count = last - q;
            }
            unsigned char *o = dst + (lo - a);
            size_t done = 0;
#if B64_X86
            if (b64_use_avx2 && count >= 8) {
                size_t blocks = count / 8;
                if (blocks * 24 + 8 > b - lo) {
                    blocks--;
                }
                done = b64_avx2(p + q * 4, blocks, o) * 8;
                if (done < blocks * 8) {
                    return -1; /* a character outside the alphabet */
                }
            }
#endif
            if (b64_scalar(p + (q + done) * 4, count - done, o + done * 3) < 0) {
                return -1;
            }
            q += count;
            continue;
        }
        int got = b64_quad(p, n, pad, q, tmp);
        if (got < 0) {
            return -1;
        }
        for (size_t i = 0; i < (size_t)got; i++) {
            if (lo + i >= a && lo + i < b) {
                dst[lo + i - a] = tmp[i];
            }
        }
        q++;
    }
    return 0;
}

PyDoc_STRVAR(decode_blob_doc,
"decode_blob(text, max_bytes, max_opcodes, max_memo, /)\n--\n\n"
"The value of a base64 pickle holding one bytes or bytearray value and nothing else\n"
"(PROTO 4/5, an optional FRAME, SHORT_BINBYTES, BINBYTES, BINBYTES8 or BYTEARRAY8, an\n"
"optional MEMOIZE, STOP) that the prescan accepts with these budgets, decoded from the\n"
"text straight into the value; None for any other text (decode and prescan it as usual).");

static PyObject *
decode_blob(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "decode_blob takes a str and 3 budgets");
        return NULL;
    }
    int64_t bud[3];
    for (int i = 0; i < 3; i++) {
        if (!PyLong_Check(args[i + 1])) {
            PyErr_SetString(PyExc_TypeError, "the budgets must be ints");
            return NULL;
        }
        bud[i] = budget(args[i + 1]);
        if (PyErr_Occurred()) {
            return NULL;
        }
        if (bud[i] < 0) {
            Py_RETURN_NONE;
        }
    }
    PyObject *text = args[0];
    if (PyUnicode_READY(text) < 0) {
        return NULL;
    }
    if (!PyUnicode_IS_ASCII(text)) {
        Py_RETURN_NONE;
    }
    const unsigned char *p = PyUnicode_1BYTE_DATA(text);
    size_t n = (size_t)PyUnicode_GET_LENGTH(text);
    if (n == 0 || n % 4) {
        Py_RETURN_NONE;
    }
    size_t pad = b64_pad(p, n);
    size_t total = n / 4 * 3 - pad; /* the pickle's length */
    if (total < 4 || (int64_t)total > bud[0]) {
        Py_RETURN_NONE;
    }
    /* The header: PROTO, an optional FRAME, the opcode and its length field (<= 20 bytes). */
    unsigned char hdr[20];
    size_t h = total < sizeof(hdr) ? total : sizeof(hdr);
    if (b64_range(p, n, pad, 0, h, hdr) < 0) {
        Py_RETURN_NONE;
    }
    if (hdr[0] != 0x80 || (hdr[1] != 4 && hdr[1] != 5)) {
        Py_RETURN_NONE;
    }
    size_t pos = 2;
    int64_t ops = 0;
    uint64_t frame_end = 0; /* where the FRAME ends, if there is one */
    if (hdr[pos] == 0x95) { /* FRAME: its length must fit in what follows it */
        if (h - pos < 9 || le(hdr + pos + 1, 8) > (uint64_t)(total - pos - 9)) {
            Py_RETURN_NONE;
        }
        frame_end = pos + 9 + le(hdr + pos + 1, 8);
        pos += 9;
        ops++;
    }
    if (pos >= h) {
        Py_RETURN_NONE;
    }
    unsigned char op = hdr[pos];
    size_t width = op == 0x43 ? 1 : op == 0x42 ? 4 : (op == 0x8E || op == 0x96) ? 8 : 0;
    if (width == 0 || h - pos - 1 < width) {
        Py_RETURN_NONE;
    }
    uint64_t size = le(hdr + pos + 1, width);
    pos += 1 + width;
    ops++;
    if (size > (uint64_t)(total - pos)) {
        Py_RETURN_NONE;
    }
    size_t start = pos, end = pos + (size_t)size;
    /* The trailer: STOP, or MEMOIZE then STOP, and nothing after. */
    size_t rest = total - end;
    /* The frame must end between two opcodes (as in the prescan): right after itself, after
     * the bytes opcode, after MEMOIZE or after STOP. A frame ending inside the opcode's
     * header or payload is read differently by a file-fed unpickler: not sure. */
    if (frame_end && frame_end != start - 1 - width && frame_end != end
        && !(rest == 2 && frame_end == end + 1) && frame_end != total) {
        Py_RETURN_NONE;
    }
    unsigned char tail[2];
    if ((rest != 1 && rest != 2) || b64_range(p, n, pad, end, total, tail) < 0) {
        Py_RETURN_NONE;
    }
    if (rest == 2) {
        if (tail[0] != 0x94 || bud[2] < 1) {
            Py_RETURN_NONE;
        }
        ops++;
    }
    ops++;
    if (tail[rest - 1] != 0x2E || ops > bud[1]) {
        Py_RETURN_NONE;
    }
    PyObject *out;
    unsigned char *dst;
    if (op == 0x96) {
        out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)size);
        dst = out ? (unsigned char *)PyByteArray_AS_STRING(out) : NULL;
    }
    else {
        out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
        dst = out ? (unsigned char *)PyBytes_AS_STRING(out) : NULL;
    }
    if (out == NULL) {
        return NULL;
    }
    if (b64_range(p, n, pad, start, end, dst) < 0) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

PyDoc_STRVAR(b64decode_doc,
"b64decode(text, /)\n--\n\n"
"The bytes of canonical base64 text (the alphabet A-Z a-z 0-9 + /, a length that is a\n"
"multiple of 4, at most two '=' at the end, zero padding bits); None for anything else.");

static PyObject *
b64decode(PyObject *module, PyObject *text)
{
    if (!PyUnicode_Check(text)) {
        PyErr_SetString(PyExc_TypeError, "b64decode takes a str");
        return NULL;
    }
    if (PyUnicode_READY(text) < 0) {
        return NULL;
    }
    if (!PyUnicode_IS_ASCII(text)) {
        Py_RETURN_NONE;
    }
    const unsigned char *p = PyUnicode_1BYTE_DATA(text);
    size_t n = (size_t)PyUnicode_GET_LENGTH(text);
    if (n % 4) {
        Py_RETURN_NONE;
    }
    if (n == 0) {
        return PyBytes_FromStringAndSize(NULL, 0);
    }
    size_t pad = b64_pad(p, n);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n / 4 * 3 - pad));
    if (out == NULL) {
        return NULL;
    }
    if (b64_into(p, n, (unsigned char *)PyBytes_AS_STRING(out), pad) < 0) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

PyDoc_STRVAR(vector_doc,
"vector(enabled=None, /)\n--\n\n"
"Whether the base64 decoders use their AVX2 loop; `enabled` turns it on (where the CPU has\n"
"AVX2) or off, so the tests can check the scalar code on any machine.");

static PyObject *
vector(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "vector takes at most 1 argument");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) {
        int on = PyObject_IsTrue(args[0]);
        if (on < 0) {
            return NULL;
        }
        b64_use_avx2 = on && b64_have_avx2;
    }
    return PyBool_FromLong(b64_use_avx2);
}

PyDoc_STRVAR(probes_doc,
"probes()\n--\n\n"
"How many hash-table probe steps the prescan has taken in this process (for the tests that\n"
"bound its cost).");

static PyObject *
probes(PyObject *module, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(probe_steps);
}

static PyMethodDef module_methods[] = {
    {"probes", probes, METH_NOARGS, probes_doc},
    {"prescan_data", (PyCFunction)(void (*)(void))prescan_data, METH_FASTCALL, prescan_data_doc},
    {"b64decode", b64decode, METH_O, b64decode_doc},
    {"decode_blob", (PyCFunction)(void (*)(void))decode_blob, METH_FASTCALL, decode_blob_doc},
    {"vector", (PyCFunction)(void (*)(void))vector, METH_FASTCALL, vector_doc},
    {NULL},
};

static struct PyModuleDef fastscan_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "agent_sandbox._host.intake._fastscan",
    .m_doc = PyDoc_STR("The host's native decoding helpers (see agent_sandbox._host.intake)."),
    .m_size = -1,
    .m_methods = module_methods,
};

/* The keys of `slot`, from os.urandom (a fresh pair in every process that loads this). */
static int
seed_slots(void)
{
    PyObject *os = PyImport_ImportModule("os");
    if (os == NULL) {
        return -1;
    }
    PyObject *raw = PyObject_CallMethod(os, "urandom", "i", 16);
    Py_DECREF(os);
    if (raw == NULL) {
        return -1;
    }
    if (!PyBytes_Check(raw) || PyBytes_GET_SIZE(raw) != 16) {
        Py_DECREF(raw);
        PyErr_SetString(PyExc_RuntimeError, "os.urandom gave no 16 bytes");
        return -1;
    }
    const unsigned char *k = (const unsigned char *)PyBytes_AS_STRING(raw);
    slot_key0 = le(k, 8);
    slot_key1 = le(k + 8, 8);
    Py_DECREF(raw);
    return 0;
}

PyMODINIT_FUNC
PyInit__fastscan(void)
{
    b64_init();
    if (seed_slots() < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&fastscan_module);
    if (module == NULL) {
        return NULL;
    }
    PyObject *all = Py_BuildValue("[ssssss]", "VERSION", "b64decode", "decode_blob", "prescan_data", "probes", "vector");
    if (all == NULL || PyModule_AddIntConstant(module, "VERSION", 3) < 0
        || PyModule_AddObjectRef(module, "__all__", all) < 0) {
        Py_XDECREF(all);
        Py_DECREF(module);
        return NULL;
    }
    Py_DECREF(all);
    return module;
}
