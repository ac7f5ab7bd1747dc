/* Compiled event scanner: a batch of trace events (the content of a JSON array of objects)
 * straight into columns, for the well-formed common case only.
 *
 * `Scanner.scan(buf, start, stop)` reads bytes [start, stop) of `buf` as the content of a JSON
 * array of event objects and returns (n, i32, f64, i64): n events and three bytes objects
 * holding column-major arrays (I32_COLUMNS x n int32, F64_COLUMNS x n float64, I64_COLUMNS x n
 * int64; see the enums below). String fields (ph, cat, name) are codes + 1 into the scanner's
 * string table (0: absent or null); raw fields are codes into its raw table, one key per event
 * and table (its raw-JSON argument values joined with \x01, as columns.py's _RawGroup joins
 * them). Ints absent or null are MISSING (-2**63); floats absent are NaN. `strings()` and
 * `raws()` return the keys added since their last call (string keys as their JSON text
 * between the quotes, escapes kept).
 *
 * It gives exactly what decode.py's msgspec Structs give, or declines: anything it does not
 * read the way msgspec reads it (a value of another type, an integer out of int64, a non-ASCII
 * byte in a string, an escape in a key, a repeated key, JSON it cannot prove valid) makes it
 * return a short reason (str) instead, and the batch is decoded the msgspec way. It keeps no
 * reference to `buf`, and scans without the GIL (a Scanner serves one thread at a time).
 *
 * Traces are untrusted input (docs/security.md): crafted keys cannot make the string tables
 * quadratic (table_code: a keyed hash once keys collide), column rows are reserved per event
 * read, not per byte, and tests/trace/test_hostile_ingest.py and .ci/sanitize.sh (ASan + UBSan,
 * differential tests and a bounded fuzz run against msgspec) keep it so.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* Words are read with native loads as little-endian words (key words, hashes, plain_run): a
 * big-endian build would miss every key silently, so it does not build (the install then goes
 * on without the scanner: setup.py's extension is optional) and, where the compiler cannot
 * tell, the module refuses to import (PyInit__scan); traces are then read by msgspec. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "_scan.c reads words as little-endian: not built on this big-endian target"
#endif

#define MISSING INT64_MIN
#define MAX_DEPTH 64

/* K_INT: an int64; _NULL: or null (absent); _STR: or a string, read as columns.as_int reads it
 * when it holds no digit (absent); one with a digit is declined. */
typedef enum { K_STR, K_F64, K_INT_STR_NULL, K_INT_STR, K_INT_NULL, K_INT, K_RAW, K_ARGS } Kind;

typedef struct {
    const char *key;
    size_t len;
    Kind kind;
    int column;      /* i32 / f64 / i64 column, or raw argument index */
    uint64_t w0, w1; /* the key's bytes as two words (prepare_fields) */
} Field;

#define MAX_RAW_KEY 16
typedef struct { /* a table's raw key: its raw arguments, joined with \x01 in this order */
    int column;  /* its i32 column */
    int count;
    int args[MAX_RAW_KEY];
} RawKey;

/* The column enums (S_ string codes, R_ raw keys; F_ floats; I_ ints; A_ raw arguments), their
 * names for Python, EVENT_FIELDS, ARGS_FIELDS and RAW_KEYS: generated from fields.py. */
#include "_fields.h"
#define N_EVENT_FIELDS (sizeof EVENT_FIELDS / sizeof *EVENT_FIELDS)
#define N_ARGS_FIELDS (sizeof ARGS_FIELDS / sizeof *ARGS_FIELDS)
#define N_RAW_KEYS (sizeof RAW_KEYS / sizeof *RAW_KEYS)

/* ---------------------------------------------------------------- interning tables */

typedef struct {
    uint64_t *hash;   /* per slot; 0 = empty */
    int32_t *code;    /* per slot */
    size_t cap;       /* slots, a power of 2 */
    char *arena;      /* key bytes, back to back */
    size_t used, room;
    size_t *at;       /* code -> offset of its key in arena (n + 1 entries) */
    size_t n, at_room;
    size_t handed;    /* codes already returned to Python */
    int keyed;        /* hashed with sip_hash (else fast_hash): see table_code */
} Table;

/* Two hashes of key s[:n] (never 0, which marks an empty slot). fast_hash is a multiplicative
 * hash, quick but unkeyed and invertible: anyone can write keys that collide. sip_hash is
 * SipHash-1-3 (CPython's str hash) under a key drawn from os.urandom at import, which no one
 * who writes a trace can know. */
static uint64_t fast_hash(const char *s, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
        h ^= h >> 29;
        s += 8;
        n -= 8;
    }
    uint64_t w = 0;
    for (size_t i = 0; i < n; i++) w |= (uint64_t)(unsigned char)s[i] << (8 * i);
    h = (h ^ w ^ ((uint64_t)n << 56)) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 32;
    return h | 1;
}

static uint64_t SIP_K0, SIP_K1;

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                  \
    do {                                                          \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32); \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                    \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                    \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32); \
    } while (0)

static uint64_t sip_hash(const char *s, size_t n) {
    uint64_t v0 = SIP_K0 ^ 0x736f6d6570736575ull, v1 = SIP_K1 ^ 0x646f72616e646f6dull;
    uint64_t v2 = SIP_K0 ^ 0x6c7967656e657261ull, v3 = SIP_K1 ^ 0x7465646279746573ull;
    uint64_t last = (uint64_t)n << 56;
    for (; n >= 8; s += 8, n -= 8) {
        uint64_t m;
        memcpy(&m, s, 8);
        v3 ^= m;
        SIPROUND;
        v0 ^= m;
    }
    for (size_t i = 0; i < n; i++) last |= (uint64_t)(unsigned char)s[i] << (8 * i);
    v3 ^= last;
    SIPROUND;
    v0 ^= last;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return (v0 ^ v1 ^ v2 ^ v3) | 1;
}

static inline uint64_t key_hash(int keyed, const char *s, size_t n) {
    return keyed ? sip_hash(s, n) : fast_hash(s, n);
}

static void table_free(Table *t) {
    PyMem_RawFree(t->hash);
    PyMem_RawFree(t->code);
    PyMem_RawFree(t->arena);
    PyMem_RawFree(t->at);
    memset(t, 0, sizeof *t);
}

/* A table starts with fast_hash. A lookup that probes more than MAX_PROBE slots, or meets
 * another key of the same hash, hashes the whole table again with sip_hash, for good: crafted
 * keys cost at most MAX_PROBE probes each before that, real ones (at a load of at most 1/2)
 * never get there. */
#define MAX_PROBE 128

/* The slots rebuilt into `cap` of them, hashed with sip_hash if `keyed` (else as they are);
 * -1 when out of memory, 1 when a key probes past MAX_PROBE with fast_hash (nothing changed). */
static int table_slots(Table *t, size_t cap, int keyed) {
    uint64_t *hash = PyMem_RawCalloc(cap, sizeof *hash);
    int32_t *code = PyMem_RawMalloc(cap * sizeof *code);
    int r = hash && code ? 0 : -1;
    for (size_t i = 0; r == 0 && i < t->cap; i++) {
        if (!t->hash[i]) continue;
        int32_t c = t->code[i];
        uint64_t h = keyed == t->keyed ? t->hash[i] : sip_hash(t->arena + t->at[c], t->at[c + 1] - t->at[c]);
        size_t j = h & (cap - 1), probes = 0;
        for (; hash[j]; j = (j + 1) & (cap - 1)) probes++;
        if (!keyed && probes > MAX_PROBE) r = 1;
        hash[j] = h;
        code[j] = c;
    }
    if (r != 0) {
        PyMem_RawFree(hash);
        PyMem_RawFree(code);
        return r;
    }
    PyMem_RawFree(t->hash);
    PyMem_RawFree(t->code);
    t->hash = hash;
    t->code = code;
    t->cap = cap;
    t->keyed = keyed;
    return 0;
}

static int table_grow(Table *t) {
    size_t cap = t->cap ? t->cap * 2 : 1024;
    int r = table_slots(t, cap, t->keyed);
    return r == 1 ? table_slots(t, cap, 1) : r;
}

/* The code of key s[:n], added if new; -1 when out of memory. */
static int32_t table_code(Table *t, const char *s, size_t n) {
    if ((t->n + 1) * 2 > t->cap && table_grow(t) < 0) return -1;
    uint64_t h = key_hash(t->keyed, s, n);
    size_t j = h & (t->cap - 1), probes = 0;
    for (; t->hash[j]; j = (j + 1) & (t->cap - 1)) {
        if (t->hash[j] == h) {
            int32_t c = t->code[j];
            size_t a = t->at[c], len = t->at[c + 1] - a;
            if (len == n && (n == 0 || memcmp(t->arena + a, s, n) == 0)) return c;
        }
        if (!t->keyed && (t->hash[j] == h || ++probes > MAX_PROBE)) /* (crafted keys) */
            return table_slots(t, t->cap, 1) < 0 ? -1 : table_code(t, s, n);
    }
    if (t->n >= INT32_MAX - 1) return -1;
    if (!t->arena || t->used + n > t->room) { /* (allocated for an empty first key too) */
        size_t room = (t->room + n) * 2 + 4096;
        char *arena = PyMem_RawRealloc(t->arena, room);
        if (!arena) return -1;
        t->arena = arena;
        t->room = room;
    }
    if (t->n + 2 > t->at_room) {
        size_t room = t->at_room * 2 + 1024;
        size_t *at = PyMem_RawRealloc(t->at, room * sizeof *at);
        if (!at) return -1;
        t->at = at;
        t->at_room = room;
        if (t->n == 0) t->at[0] = 0;
    }
    if (n) memcpy(t->arena + t->used, s, n);
    t->used += n;
    t->at[t->n + 1] = t->used;
    t->hash[j] = h;
    t->code[j] = (int32_t)t->n;
    return (int32_t)t->n++;
}

/* table_code, first trying `*last` (a column's previous code: events in a row often repeat
 * their phase, category or name), which it then holds. */
static inline int32_t table_code_at(Table *t, const char *s, size_t n, int32_t *last) {
    int32_t c = *last;
    if (c >= 0 && t->at[c + 1] - t->at[c] == n && memcmp(t->arena + t->at[c], s, n) == 0) return c;
    return *last = table_code(t, s, n);
}

/* The keys added since the last call, as a list of bytes. */
static PyObject *table_new_keys(Table *t) {
    PyObject *out = PyList_New((Py_ssize_t)(t->n - t->handed));
    if (!out) return NULL;
    for (size_t c = t->handed; c < t->n; c++) {
        PyObject *k = PyBytes_FromStringAndSize(t->arena + t->at[c], t->at[c + 1] - t->at[c]);
        if (!k) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)(c - t->handed), k);
    }
    t->handed = t->n;
    return out;
}

/* ---------------------------------------------------------------- growable columns */

typedef struct {
    PyObject_HEAD
    Table strings, raws;
    int32_t *i32;
    double *f64;
    int64_t *i64;
    size_t room; /* events the column blocks hold */
    char *key;   /* scratch for raw keys */
    size_t key_room;
    int32_t absent[RAW_ARGS + 1]; /* by key width: the code of the key with no value, or -1 */
    int32_t last[I32_COLUMNS];    /* by column: the code last read, or -1 (see table_code_at) */
    int busy;                     /* a scan is running (without the GIL) */
} Scanner;

/* ---------------------------------------------------------------- JSON lexing */

typedef struct {
    const char *p, *end;
    const char *why; /* the reason for declining, once set */
} Lex;

static const unsigned char IS_WS[256] = {[' '] = 1, ['\n'] = 1, ['\r'] = 1, ['\t'] = 1};

/* Whitespace runs: a Kineto file indents each key on its own line, so a run is often a
 * newline and a few spaces; 16 bytes are classified at once where SSE2 is (every x86-64). */
static inline void skip_ws(Lex *x) {
    const char *p = x->p, *end = x->end;
#ifdef __SSE2__
    if (p < end && IS_WS[(unsigned char)*p]) {
        while (end - p >= 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)p);
            __m128i ws = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8(' ')), _mm_cmpeq_epi8(v, _mm_set1_epi8('\n'))),
                                      _mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8('\r')), _mm_cmpeq_epi8(v, _mm_set1_epi8('\t'))));
            unsigned other = ~(unsigned)_mm_movemask_epi8(ws) & 0xFFFF;
            if (other) {
                x->p = p + __builtin_ctz(other);
                return;
            }
            p += 16;
        }
    }
#endif
    while (p < end && IS_WS[(unsigned char)*p]) p++;
    x->p = p;
}

static inline int decline(Lex *x, const char *why) {
    if (!x->why) x->why = why;
    return -1;
}

static inline int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

#define ONES 0x0101010101010101ull
#define HIGHS 0x8080808080808080ull

/* The first byte at or after p that is not plain string content ('"', '\\', a control
 * character or a non-ASCII byte), or end: eight bytes at a time. */
static inline const char *plain_run(const char *p, const char *end) {
#ifdef __SSE2__
    while (end - p >= 16) { /* (signed bytes below 0x20: control characters and non-ASCII) */
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        __m128i hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8('"')), _mm_cmpeq_epi8(v, _mm_set1_epi8('\\'))),
                                   _mm_cmplt_epi8(v, _mm_set1_epi8(0x20)));
        unsigned m = (unsigned)_mm_movemask_epi8(hit);
        if (m) return p + __builtin_ctz(m);
        p += 16;
    }
#endif
    while (end - p >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        uint64_t quote = w ^ (ONES * '"'), slash = w ^ (ONES * '\\');
        uint64_t hit = ((quote - ONES) & ~quote) | ((slash - ONES) & ~slash) | ((w - ONES * 0x20) & ~w) | w;
        hit &= HIGHS;
        if (hit) return p + (__builtin_ctzll(hit) >> 3);
        p += 8;
    }
    while (p < end && *p != '"' && *p != '\\' && (unsigned char)*p >= 0x20 && (unsigned char)*p < 0x80) p++;
    return p;
}

/* A string at x->p (its opening quote): its content [*s, *s + *n), whether it has escapes. */
static inline __attribute__((always_inline)) int lex_string(Lex *x, const char **s, size_t *n, int *escaped) {
    const char *p = x->p + 1, *end = x->end;
    int esc = 0;
    for (;;) {
        p = plain_run(p, end);
        if (p >= end) return decline(x, "a string runs past the batch");
        unsigned char c = (unsigned char)*p;
        if (c == '"') break;
        if (c != '\\') return decline(x, c < 0x20 ? "a control character in a string" : "a non-ASCII byte");
        esc = 1;
        if (p + 1 >= end) return decline(x, "a string runs past the batch");
        char e = p[1];
        if (e == 'u') {
            if (p + 6 > end) return decline(x, "a string runs past the batch");
            int v = 0;
            for (int i = 2; i < 6; i++) {
                int h = hexval(p[i]);
                if (h < 0) return decline(x, "a bad \\u escape");
                v = v * 16 + h;
            }
            if (v >= 0xD800 && v <= 0xDFFF) return decline(x, "a surrogate escape");
            p += 6;
        } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
            p += 2;
        } else {
            return decline(x, "a bad escape");
        }
    }
    *s = x->p + 1;
    *n = (size_t)(p - *s);
    *escaped = esc;
    x->p = p + 1;
    return 0;
}

static const double POW10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* Whether the 8 bytes of word w are all ASCII digits. */
static inline int eight_digits(uint64_t w) {
    return ((w & 0xF0F0F0F0F0F0F0F0ull) | (((w + 0x0606060606060606ull) & 0xF0F0F0F0F0F0F0F0ull) >> 4)) ==
           0x3333333333333333ull;
}

/* The value of eight ASCII digits (word w, the first digit in its low byte). */
static inline uint64_t eight_value(uint64_t w) {
    w -= 0x3030303030303030ull;
    w = w * 10 + (w >> 8);
    return (((w & 0x000000FF000000FFull) * (100 + (1000000ull << 32))) +
            (((w >> 16) & 0x000000FF000000FFull) * (1 + (10000ull << 32)))) >> 32;
}

/* The digits from p on appended to *m (*over set, and *m left, once it would pass
 * UINT64_MAX - 9 before a digit); the first byte after them. Eight at a time while *m is
 * small enough for eight more. */
static inline const char *digits(const char *p, const char *end, uint64_t *m, int *over) {
    uint64_t v = *m;
    while (end - p >= 8 && v < 100000000000ull) {
        uint64_t w;
        memcpy(&w, p, 8);
        if (!eight_digits(w)) break;
        v = v * 100000000ull + eight_value(w);
        p += 8;
    }
    for (; p < end && (unsigned char)(*p - '0') < 10; p++) {
        if (v > (UINT64_MAX - 9) / 10) *over = 1;
        else v = v * 10 + (uint64_t)(*p - '0');
    }
    *m = v;
    return p;
}

/* A number at x->p, validated. With `want`: *is_int (no fraction or exponent; then *iv is its
 * value and *fits whether it is within int64) and *dv (its value as the nearest double);
 * without, the outputs are not touched (they may be NULL). */
static int lex_number(Lex *x, int want, int *is_int, int *fits, int64_t *iv, double *dv) {
    const char *p = x->p, *end = x->end, *start = p;
    int neg = 0;
    if (p < end && *p == '-') {
        neg = 1;
        p++;
    }
    if (p >= end || *p < '0' || *p > '9') return decline(x, "not a JSON value");
    uint64_t m = 0;
    int over = 0;
    if (*p == '0') {
        p++;
    } else {
        p = digits(p, end, &m, &over);
    }
    int frac = 0, exp10 = 0, integral = 1;
    if (p < end && *p == '.') {
        integral = 0;
        p++;
        if (p >= end || *p < '0' || *p > '9') return decline(x, "a bad number");
        const char *f = p;
        p = digits(p, end, &m, &over);
        frac = (int)(p - f);
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        integral = 0;
        p++;
        int eneg = 0;
        if (p < end && (*p == '+' || *p == '-')) eneg = *p++ == '-';
        if (p >= end || *p < '0' || *p > '9') return decline(x, "a bad number");
        int e = 0;
        while (p < end && *p >= '0' && *p <= '9') {
            if (e < 100000) e = e * 10 + (*p - '0');
            p++;
        }
        exp10 = eneg ? -e : e;
    }
    if (p >= end) return decline(x, "a number runs past the batch");
    x->p = p;
    if (!want) return 0;
    if (integral && over) return decline(x, "an integer out of uint64");
    *is_int = integral;
    *fits = 0;
    if (integral && !over) {
        if (!neg && m <= (uint64_t)INT64_MAX) {
            *fits = 1;
            *iv = (int64_t)m;
        } else if (neg && m <= (uint64_t)INT64_MAX) {  /* > MISSING, which means absent */
            *fits = 1;
            *iv = -(int64_t)m;
        }
    }
    int e = exp10 - frac;
    if (integral && m == 0) neg = 0; /* (an integer -0 is the int 0, as a float 0.0) */
    if (!over && m <= (1ull << 53) && e >= -22 && e <= 22) {  /* exact: one rounding */
        double d = (double)m;
        d = e < 0 ? d / POW10[-e] : d * POW10[e];
        *dv = neg ? -d : d;
        return 0;
    }
    if (integral && !over) {  /* (a correctly rounded conversion) */
        double d = (double)m;
        *dv = neg ? -d : d;
        return 0;
    }
    size_t len = (size_t)(p - start);
    if (len > 300) return decline(x, "a long number");
    char tmp[320];
    memcpy(tmp, start, len);
    tmp[len] = 0;
    PyGILState_STATE gil = PyGILState_Ensure(); /* (the scan runs without the GIL) */
    double d = PyOS_string_to_double(tmp, NULL, NULL);
    int bad = d == -1.0 && PyErr_Occurred();
    if (bad) PyErr_Clear();
    PyGILState_Release(gil);
    if (bad) return decline(x, "a bad number");
    if (!isfinite(d)) return decline(x, "a number out of range");
    *dv = d;
    return 0;
}

static int skip_value(Lex *x, int depth);

static int lex_literal(Lex *x, const char *word, size_t n) {
    if ((size_t)(x->end - x->p) <= n || memcmp(x->p, word, n) != 0) return decline(x, "not a JSON value");
    x->p += n;
    return 0;
}

/* Any JSON value at x->p, validated and skipped. */
static int skip_value(Lex *x, int depth) {
    if (x->p >= x->end) return decline(x, "a value runs past the batch");
    char c = *x->p;
    const char *s;
    size_t n;
    int esc;
    switch (c) {
    case '"':
        return lex_string(x, &s, &n, &esc);
    case 't':
        return lex_literal(x, "true", 4);
    case 'f':
        return lex_literal(x, "false", 5);
    case 'n':
        return lex_literal(x, "null", 4);
    case '[':
    case '{': {
        if (depth >= MAX_DEPTH) return decline(x, "nested too deeply");
        char close = c == '[' ? ']' : '}';
        x->p++;
        skip_ws(x);
        if (x->p < x->end && *x->p == close) {
            x->p++;
            return 0;
        }
        for (;;) {
            if (close == '}') {
                if (x->p >= x->end || *x->p != '"') return decline(x, "an object key is not a string");
                if (lex_string(x, &s, &n, &esc) < 0) return -1;
                skip_ws(x);
                if (x->p >= x->end || *x->p != ':') return decline(x, "no ':' after a key");
                x->p++;
                skip_ws(x);
            }
            if (skip_value(x, depth + 1) < 0) return -1;
            skip_ws(x);
            if (x->p >= x->end) return decline(x, "a value runs past the batch");
            if (*x->p == close) {
                x->p++;
                return 0;
            }
            if (*x->p != ',') return decline(x, "no ',' between values");
            x->p++;
            skip_ws(x);
        }
    }
    default:
        return lex_number(x, 0, NULL, NULL, NULL, NULL);
    }
}

/* ---------------------------------------------------------------- fields */

/* Key bytes [off, off + 8) of s[:n] as a little-endian word, zero past n. */
static inline uint64_t key_word(const char *s, size_t n, size_t off) {
    uint64_t w = 0;
    for (size_t i = off; i < n && i < off + 8; i++) w |= (uint64_t)(unsigned char)s[i] << (8 * (i - off));
    return w;
}

static inline uint64_t low_bytes(uint64_t w, size_t k) {
    return k >= 8 ? w : w & ((1ull << (8 * k)) - 1);
}

/* Fill in the fields' key words. */
static void prepare_fields(Field *fields, size_t count) {
    for (size_t i = 0; i < count; i++) {
        fields[i].w0 = key_word(fields[i].key, fields[i].len, 0);
        fields[i].w1 = key_word(fields[i].key, fields[i].len, 8);
    }
}

/* Field lookup by the key's words: a 64-slot table per field list, the slot a multiplicative
 * hash of the words and the length whose multiplier is the first found at import that puts
 * every field in a slot of its own (none found: the lookup is a linear search). */
#define SLOTS 64
typedef struct {
    Field *fields;
    size_t count;
    uint64_t mul;
    int8_t slot[SLOTS]; /* field index + 1, 0: none */
    int usable;
} Lookup;

static inline unsigned slot_of(uint64_t mul, uint64_t w0, uint64_t w1, size_t n) {
    uint64_t h = (w0 ^ (w1 * 0xFF51AFD7ED558CCDull) ^ n) * mul;
    h ^= h >> 32;
    return (unsigned)((h * 0xBF58476D1CE4E5B9ull) >> 58);
}

static void prepare_lookup(Lookup *lk, Field *fields, size_t count) {
    prepare_fields(fields, count);
    lk->fields = fields;
    lk->count = count;
    lk->usable = 0;
    for (uint64_t k = 0; k < 4096 && !lk->usable; k++) {
        lk->mul = 0x9E3779B97F4A7C15ull + 2 * k;
        lk->usable = 1;
        memset(lk->slot, 0, sizeof lk->slot);
        for (size_t i = 0; i < count && lk->usable; i++) {
            unsigned j = slot_of(lk->mul, fields[i].w0, fields[i].w1, fields[i].len);
            if (lk->slot[j]) lk->usable = 0;
            lk->slot[j] = (int8_t)(i + 1);
        }
    }
}

/* The index of key s[:n] among the lookup's fields (keys of at most 16 bytes), or -1. `room`:
 * the bytes readable from s (16 or more: the key words are two plain loads). */
static int find_in(const Lookup *lk, const char *s, size_t n, size_t room) {
    if (n > 16) return -1;
    uint64_t w0, w1;
    if (room >= 16) {
        memcpy(&w0, s, 8);
        memcpy(&w1, s + 8, 8);
        w0 = low_bytes(w0, n);
        w1 = n > 8 ? low_bytes(w1, n - 8) : 0;
    } else {
        w0 = key_word(s, n, 0);
        w1 = key_word(s, n, 8);
    }
    const Field *f = lk->fields;
    if (lk->usable) {
        int i = lk->slot[slot_of(lk->mul, w0, w1, n)] - 1;
        return i >= 0 && f[i].w0 == w0 && f[i].w1 == w1 && f[i].len == n ? i : -1;
    }
    for (size_t i = 0; i < lk->count; i++)
        if (f[i].w0 == w0 && f[i].len == n && f[i].w1 == w1) return (int)i;
    return -1;
}

typedef struct {
    const char *raw[RAW_ARGS];
    size_t raw_len[RAW_ARGS];
} RawArgs;

/* One row's values as they are read. */
typedef struct {
    int32_t *i32;
    double *f64;
    int64_t *i64;
    size_t n, row;
} Row;

static Lookup EVENT_LOOKUP, ARGS_LOOKUP;

static int read_fields(Scanner *sc, Lex *x, const Lookup *lk, Row *r, RawArgs *ra, int depth);

/* The value of a known field at x->p, into the row. */
static int read_field(Scanner *sc, Lex *x, const Field *f, Row *r, RawArgs *ra, int depth) {
    const char *s;
    size_t n;
    int esc, is_int, fits;
    int64_t iv;
    double dv;
    if (x->p >= x->end) return decline(x, "a value runs past the batch");
    char c = *x->p;
    switch (f->kind) {
    case K_STR:
        if (c == 'n') return lex_literal(x, "null", 4); /* (the row already says absent) */
        if (c != '"') return decline(x, "a string field of another type");
        if (lex_string(x, &s, &n, &esc) < 0) return -1;
        {
            int32_t code = table_code_at(&sc->strings, s, n, &sc->last[f->column]);
            if (code < 0) return decline(x, "out of memory");
            r->i32[f->column * r->n + r->row] = code + 1;
        }
        return 0;
    case K_F64:
        if (c != '-' && (c < '0' || c > '9')) return decline(x, "a float field of another type");
        if (lex_number(x, 1, &is_int, &fits, &iv, &dv) < 0) return -1;
        r->f64[f->column * r->n + r->row] = dv;
        return 0;
    case K_INT_STR_NULL:
    case K_INT_NULL:
        if (c == 'n') return lex_literal(x, "null", 4);
        /* fall through */
    case K_INT_STR:
    case K_INT:
        if (c == '"' && (f->kind == K_INT_STR_NULL || f->kind == K_INT_STR)) {
            if (lex_string(x, &s, &n, &esc) < 0) return -1;
            for (size_t i = 0; i < n; i++)
                if (esc || (s[i] >= '0' && s[i] <= '9')) return decline(x, "an int field holds a string with a digit");
            return 0; /* (MISSING, as the row already says) */
        }
        if (c != '-' && (c < '0' || c > '9')) return decline(x, "an int field of another type");
        if (lex_number(x, 1, &is_int, &fits, &iv, &dv) < 0) return -1;
        if (!is_int || !fits) return decline(x, "an int field out of int64");
        r->i64[f->column * r->n + r->row] = iv;
        return 0;
    case K_RAW: {
        const char *a = x->p;
        if (skip_value(x, depth) < 0) return -1;
        ra->raw[f->column] = a;
        ra->raw_len[f->column] = (size_t)(x->p - a);
        return 0;
    }
    case K_ARGS:
        if (c != '{') return decline(x, "args is not an object");
        return read_fields(sc, x, &ARGS_LOOKUP, r, ra, depth + 1);
    }
    return decline(x, "an unknown field kind");
}

/* An object at x->p whose known keys are `fields`; others are skipped. */
static int read_fields(Scanner *sc, Lex *x, const Lookup *lk, Row *r, RawArgs *ra, int depth) {
    uint32_t seen = 0;
    const char *s;
    size_t n;
    int esc;
    if (depth >= MAX_DEPTH) return decline(x, "nested too deeply");
    x->p++; /* '{' */
    skip_ws(x);
    if (x->p < x->end && *x->p == '}') {
        x->p++;
        return 0;
    }
    for (;;) {
        if (x->p >= x->end || *x->p != '"') return decline(x, "an object key is not a string");
        if (lex_string(x, &s, &n, &esc) < 0) return -1;
        if (esc) return decline(x, "an escape in a key");
        skip_ws(x);
        if (x->p >= x->end || *x->p != ':') return decline(x, "no ':' after a key");
        x->p++;
        skip_ws(x);
        int i = find_in(lk, s, n, (size_t)(x->end - s));
        if (i >= 0) {
            if (seen & (1u << i)) return decline(x, "a repeated key");
            seen |= 1u << i;
            if (read_field(sc, x, &lk->fields[i], r, ra, depth) < 0) return -1;
        } else if (skip_value(x, depth + 1) < 0) {
            return -1;
        }
        skip_ws(x);
        if (x->p >= x->end) return decline(x, "an object runs past the batch");
        if (*x->p == '}') {
            x->p++;
            return 0;
        }
        if (*x->p != ',') return decline(x, "no ',' between members");
        x->p++;
        skip_ws(x);
    }
}

/* ---------------------------------------------------------------- the scanner */

/* Move the first `used` rows of each of a block's `columns` from a layout of `from` rows per
 * column to one of `to` (> from) rows: the last column first, each moving up past the rest. */
static void spread(void *block, size_t columns, size_t from, size_t to, size_t used, size_t item) {
    char *b = block;
    for (size_t c = columns; used && c-- > 1;) memmove(b + c * to * item, b + c * from * item, used * item);
}

/* Room in the column blocks for at least `events` rows, the first `used` of each column kept;
 * -1 when out of memory (the blocks are then as they were). Rows are reserved as events are
 * read, not from the bytes of a batch: a '{' in a string is no event. */
static int reserve(Scanner *sc, size_t events, size_t used) {
    if (events <= sc->room) return 0;
    size_t room = events * 2 + 256;
    if (room > SIZE_MAX / (I64_COLUMNS * sizeof(int64_t))) return -1;
    int32_t *i32 = PyMem_RawRealloc(sc->i32, room * I32_COLUMNS * sizeof *i32);
    if (i32) sc->i32 = i32;
    double *f64 = PyMem_RawRealloc(sc->f64, room * F64_COLUMNS * sizeof *f64);
    if (f64) sc->f64 = f64;
    int64_t *i64 = PyMem_RawRealloc(sc->i64, room * I64_COLUMNS * sizeof *i64);
    if (i64) sc->i64 = i64;
    if (!i32 || !f64 || !i64) return -1;
    spread(sc->i32, I32_COLUMNS, sc->room, room, used, sizeof *i32);
    spread(sc->f64, F64_COLUMNS, sc->room, room, used, sizeof *f64);
    spread(sc->i64, I64_COLUMNS, sc->room, room, used, sizeof *i64);
    sc->room = room;
    return 0;
}

static const char SEPARATORS[MAX_RAW_KEY] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

/* Whether raw key `c` of table `t` is the parts `idx` (count of them) joined with \x01. */
static inline int same_raw_key(const Table *t, int32_t c, const RawArgs *ra, const int *idx, int count) {
    const char *k = t->arena + t->at[c], *kend = t->arena + t->at[c + 1];
    for (int i = 0; i < count; i++) {
        size_t n = ra->raw_len[idx[i]];
        if (i && (k >= kend || *k++ != '\x01')) return 0;
        if ((size_t)(kend - k) < n || (n && memcmp(k, ra->raw[idx[i]], n) != 0)) return 0;
        k += n;
    }
    return k == kend;
}

/* The code of raw key `rk` of the event whose raw arguments are `ra`: its values joined with
 * \x01 (`*last`, the column's previous code, tried first, then set). */
static int32_t raw_code(Scanner *sc, const RawArgs *ra, const RawKey *rk, int32_t *last) {
    const int *idx = rk->args, count = rk->count;
    int present = 0;
    for (int i = 0; i < count; i++) present |= ra->raw_len[idx[i]] != 0;
    if (!present) { /* (the key of none: count - 1 separators, interned once) */
        int32_t *absent = &sc->absent[count];
        if (*absent < 0) *absent = table_code(&sc->raws, SEPARATORS, (size_t)(count - 1));
        return *absent;
    }
    if (*last >= 0 && same_raw_key(&sc->raws, *last, ra, idx, count)) return *last;
    size_t need = (size_t)count;
    for (int i = 0; i < count; i++) need += ra->raw_len[idx[i]];
    if (need > sc->key_room) {
        char *key = PyMem_RawRealloc(sc->key, need * 2);
        if (!key) return -1;
        sc->key = key;
        sc->key_room = need * 2;
    }
    size_t k = 0;
    for (int i = 0; i < count; i++) {
        if (i) sc->key[k++] = '\x01';
        if (ra->raw_len[idx[i]]) memcpy(sc->key + k, ra->raw[idx[i]], ra->raw_len[idx[i]]); /* (else NULL) */
        k += ra->raw_len[idx[i]];
    }
    return *last = table_code(&sc->raws, sc->key, k);
}

/* Events of text [p, end) into the column blocks (laid out for sc->room rows, grown as
 * needed); their number, or -1. */
static Py_ssize_t scan_events(Scanner *sc, Lex *x) {
    size_t row = 0;
    skip_ws(x);
    if (x->p >= x->end) return 0;
    for (;;) {
        if (*x->p != '{') return decline(x, "an event is not an object");
        if (reserve(sc, row + 1, row) < 0) return decline(x, "out of memory");
        size_t room = sc->room;
        Row r = {sc->i32, sc->f64, sc->i64, room, row};
        for (int c = 0; c < I32_COLUMNS; c++) sc->i32[c * room + row] = 0;
        for (int c = 0; c < F64_COLUMNS; c++) sc->f64[c * room + row] = NAN;
        for (int c = 0; c < I64_COLUMNS; c++) sc->i64[c * room + row] = MISSING;
        RawArgs ra;
        memset(ra.raw_len, 0, sizeof ra.raw_len); /* (raw[i] is read only where raw_len[i] is set) */
        if (read_fields(sc, x, &EVENT_LOOKUP, &r, &ra, 1) < 0) return -1;
        for (size_t k = 0; k < N_RAW_KEYS; k++) {
            int32_t code = raw_code(sc, &ra, &RAW_KEYS[k], &sc->last[RAW_KEYS[k].column]);
            if (code < 0) return decline(x, "out of memory");
            sc->i32[RAW_KEYS[k].column * room + row] = code;
        }
        row++;
        skip_ws(x);
        if (x->p >= x->end) return (Py_ssize_t)row;
        if (*x->p != ',') return decline(x, "no ',' between events");
        x->p++;
        skip_ws(x);
        if (x->p >= x->end) return decline(x, "a trailing ','");
    }
}

static PyObject *busy_error(void) {
    PyErr_SetString(PyExc_RuntimeError, "this Scanner is scanning in another thread");
    return NULL;
}

static PyObject *packed(const void *data, size_t columns, size_t room, size_t n, size_t item) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(columns * n * item));
    if (!out) return NULL;
    char *dst = PyBytes_AS_STRING(out);
    for (size_t c = 0; n && c < columns; c++) /* (no events: data may be NULL) */
        memcpy(dst + c * n * item, (const char *)data + c * room * item, n * item);
    return out;
}

static PyObject *Scanner_scan(Scanner *sc, PyObject *args) {
    Py_buffer view;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "y*nn", &view, &start, &stop)) return NULL;
    if (start < 0 || stop < start || stop > view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "scan: start and stop must satisfy 0 <= start <= stop <= len(buf)");
        return NULL;
    }
    if (sc->busy) { /* (scan_events may move the blocks that another thread's scan is writing) */
        PyBuffer_Release(&view);
        return busy_error();
    }
    const char *base = (const char *)view.buf;
    Lex x = {base + start, base + stop, NULL};
    Py_ssize_t n;
    sc->busy = 1;
    Py_BEGIN_ALLOW_THREADS /* (other threads run meanwhile: the parse worker's receiver) */
    n = scan_events(sc, &x);
    Py_END_ALLOW_THREADS
    sc->busy = 0;
    PyBuffer_Release(&view);
    if (n < 0) return PyUnicode_FromString(x.why ? x.why : "declined");
    size_t room = sc->room;
    PyObject *a = packed(sc->i32, I32_COLUMNS, room, (size_t)n, sizeof(int32_t));
    PyObject *b = a ? packed(sc->f64, F64_COLUMNS, room, (size_t)n, sizeof(double)) : NULL;
    PyObject *c = b ? packed(sc->i64, I64_COLUMNS, room, (size_t)n, sizeof(int64_t)) : NULL;
    PyObject *out = c ? Py_BuildValue("nOOO", n, a, b, c) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(c);
    return out;
}

static PyObject *Scanner_strings(Scanner *sc, PyObject *Py_UNUSED(ignored)) {
    return sc->busy ? busy_error() : table_new_keys(&sc->strings);
}

static PyObject *Scanner_raws(Scanner *sc, PyObject *Py_UNUSED(ignored)) {
    return sc->busy ? busy_error() : table_new_keys(&sc->raws);
}

static PyObject *Scanner_keyed(Scanner *sc, PyObject *Py_UNUSED(ignored)) {
    return sc->busy ? busy_error() : Py_BuildValue("(OO)", sc->strings.keyed ? Py_True : Py_False,
                                                   sc->raws.keyed ? Py_True : Py_False);
}

static void Scanner_dealloc(Scanner *sc) {
    table_free(&sc->strings);
    table_free(&sc->raws);
    PyMem_RawFree(sc->i32);
    PyMem_RawFree(sc->f64);
    PyMem_RawFree(sc->i64);
    PyMem_RawFree(sc->key);
    Py_TYPE(sc)->tp_free((PyObject *)sc);
}

static PyObject *Scanner_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Scanner *sc = (Scanner *)PyType_GenericNew(type, args, kwds);
    if (sc) {
        for (int i = 0; i <= RAW_ARGS; i++) sc->absent[i] = -1;
        for (int i = 0; i < I32_COLUMNS; i++) sc->last[i] = -1;
    }
    return (PyObject *)sc;
}

static PyMethodDef Scanner_methods[] = {
    {"scan", (PyCFunction)Scanner_scan, METH_VARARGS,
     "scan(buf, start, stop) -> (n, i32, f64, i64) columns of the events in buf[start:stop], "
     "or a str saying why they are left to the msgspec decoder."},
    {"strings", (PyCFunction)Scanner_strings, METH_NOARGS, "String keys added since the last call."},
    {"raws", (PyCFunction)Scanner_raws, METH_NOARGS, "Raw keys added since the last call."},
    {"keyed", (PyCFunction)Scanner_keyed, METH_NOARGS,
     "(strings, raws): whether each table hashes with keyed SipHash (after colliding keys)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trace_roofline.trace._scan.Scanner",
    .tp_basicsize = sizeof(Scanner),
    .tp_dealloc = (destructor)Scanner_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Trace events -> columns, with string and raw-key tables kept across batches.",
    .tp_methods = Scanner_methods,
    .tp_new = Scanner_new,
};

static struct PyModuleDef scan_module = {
    PyModuleDef_HEAD_INIT, "_scan", "Compiled event scanner (see _scan.c).", -1, NULL,
};

/* PyModule_AddObjectRef that also drops `value` (Python < 3.13 has no PyModule_Add). */
static int add_constant(PyObject *m, const char *name, PyObject *value) {
    int r = value ? PyModule_AddObjectRef(m, name, value) : -1;
    Py_XDECREF(value);
    return r;
}

/* A tuple of the `n` strings `v`. */
static PyObject *names(const char *const *v, int n) {
    PyObject *out = PyTuple_New(n);
    for (int i = 0; out && i < n; i++) {
        PyObject *s = PyUnicode_FromString(v[i]);
        if (!s) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, s);
    }
    return out;
}

/* The SipHash key, from os.urandom (a forked worker keeps its parent's: still secret). */
static int seed_hash(void) {
    PyObject *os = PyImport_ImportModule("os");
    PyObject *key = os ? PyObject_CallMethod(os, "urandom", "i", 16) : NULL;
    Py_XDECREF(os);
    if (!key) return -1;
    int ok = PyBytes_Check(key) && PyBytes_GET_SIZE(key) == 16;
    if (ok) {
        memcpy(&SIP_K0, PyBytes_AS_STRING(key), 8);
        memcpy(&SIP_K1, PyBytes_AS_STRING(key) + 8, 8);
    }
    Py_DECREF(key);
    if (!ok) PyErr_SetString(PyExc_ImportError, "_scan: os.urandom(16) gave no 16 bytes");
    return ok ? 0 : -1;
}

PyMODINIT_FUNC PyInit__scan(void) {
    const uint32_t one = 1;
    if (*(const unsigned char *)&one != 1) { /* (the guard above, where the compiler cannot tell) */
        PyErr_SetString(PyExc_ImportError, "_scan: a big-endian machine (the msgspec path reads traces)");
        return NULL;
    }
    if (seed_hash() < 0 || PyType_Ready(&ScannerType) < 0) return NULL;
    prepare_lookup(&EVENT_LOOKUP, EVENT_FIELDS, N_EVENT_FIELDS);
    prepare_lookup(&ARGS_LOOKUP, ARGS_FIELDS, N_ARGS_FIELDS);
    PyObject *m = PyModule_Create(&scan_module);
    if (!m) return NULL;
    Py_INCREF(&ScannerType);
    if (PyModule_AddObject(m, "Scanner", (PyObject *)&ScannerType) < 0) {
        Py_DECREF(&ScannerType);
        Py_DECREF(m);
        return NULL;
    }
    /* whether both key lookups are hashed (a test keeps it so as keys are added) */
    if (PyModule_AddIntConstant(m, "HASHED_LOOKUPS", EVENT_LOOKUP.usable && ARGS_LOOKUP.usable) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* the columns of scan()'s three blocks, by the field paths of fields.py */
    if (add_constant(m, "I32_COLUMNS", names(I32_NAMES, I32_COLUMNS)) < 0 ||
        add_constant(m, "F64_COLUMNS", names(F64_NAMES, F64_COLUMNS)) < 0 ||
        add_constant(m, "I64_COLUMNS", names(I64_NAMES, I64_COLUMNS)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
