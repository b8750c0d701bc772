/* The opcode scan of nblib/cache/pickle_fast.py: one pickle whose top object is a list, read over a
 * memory map of the file. It builds nothing; it walks every opcode (protocols 0-5, frames), checks
 * every length against the file's end, simulates the stack (each item: where it starts, and for short
 * strings where their text is), and returns a plan:
 *   - where each element of the top list starts and ends (the bytes between are one element's ops);
 *   - per memo slot, the byte of the last op reading it (-1: never read), so slots can be dropped;
 *   - the byte of each FRAME op (its 9 bytes are left out of what is fed to the unpickler);
 *   - the globals the file names (GLOBAL, INST, STACK_GLOBAL of two strings), "module name\n" each.
 * Anything it does not plan (another top object, an element reading its own list, a persistent id,
 * an extension code, an out-of-band buffer, a memo slot written out of order, a damaged file) returns
 * status 1 with a reason: the pure-Python reader then reads the file, and says what is wrong.
 * It never reads past `size` and never writes past what it allocated; on any allocation failure it
 * returns status 1.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct {
    int64_t end;                        /* the byte after STOP */
    int status;                         /* 0: planned; 1: not planned (reason) */
    char reason[96];
    int protocol;
    int64_t prefix_end;                 /* the byte after the top list is made (and memoized) */
    int64_t n_elems, *starts, *ends, *slots_after;  /* slots_after: memo slots written when an element ends */
    int64_t n_slots, *last_read;
    int64_t n_frames, *frames;
    int64_t globals_len;
    char *globals;
} plan_t;

/* a string's place in the file, packed: its offset << 13 | its length (at most 4096); -1: not a string */
#define STR(off, len) ((off) << 13 | (len))
typedef struct { int64_t start, slots, str; } item_t;   /* slots: memo slots written when the item started */

typedef struct {
    const uint8_t *buf;
    int64_t size, pos;
    item_t *stack; int64_t depth, cap;
    int64_t *marks, *mark_at, *mark_slots; int64_t n_marks, marks_cap;  /* per MARK: its level's base, byte, slots */
    int64_t *str; int64_t slots_cap;    /* per memo slot: its string, if one (STR) */
    int64_t elems_cap, frames_cap, globals_cap;
    int64_t list_slot;                  /* the top list's memo slot (-1: not memoized, -2: no list yet) */
    int64_t elem_start;                 /* where the element built at the bottom started (-1: none) */
    plan_t *p;
} scan_t;

#define FAIL(s, why) do { strncpy((s)->p->reason, (why), sizeof((s)->p->reason) - 1); return -1; } while (0)

static int grow(void **arr, int64_t *cap, int64_t need, size_t width) {
    if (need <= *cap) return 0;
    int64_t n = *cap ? *cap : 64;
    while (n < need) n *= 2;
    void *m = realloc(*arr, (size_t)n * width);
    if (!m) return -1;
    *arr = m; *cap = n;
    return 0;
}

/* the level above the innermost MARK: items at or past its base */
static int64_t level_base(scan_t *s) { return s->n_marks ? s->marks[s->n_marks - 1] : 0; }

/* push one item; at the bottom, above the top list, it starts an element */
static int push(scan_t *s, int64_t start, int64_t slots, int64_t str) {
    if (grow((void **)&s->stack, &s->cap, s->depth + 1, sizeof(item_t))) FAIL(s, "out of memory");
    if (!s->n_marks && s->depth == 1 && s->elem_start < 0) s->elem_start = start;
    s->stack[s->depth++] = (item_t){start, slots, str};
    return 0;
}

/* pop n items of the current level; the first popped (where the result starts) through *first */
static int pop(scan_t *s, int64_t n, item_t *first) {
    if (s->depth - level_base(s) < n) FAIL(s, "an opcode needs more items than the stack holds");
    if (n && first) *first = s->stack[s->depth - n];
    s->depth -= n;
    return 0;
}

static int pop_mark(scan_t *s, item_t *first) {
    if (!s->n_marks) FAIL(s, "an opcode needs a MARK and there is none");
    s->n_marks--;
    s->depth = s->marks[s->n_marks];
    first->start = s->mark_at[s->n_marks];
    first->slots = s->mark_slots[s->n_marks];
    return 0;
}

static int add_element(scan_t *s, int64_t start, int64_t end, int64_t slots_after) {
    plan_t *p = s->p;
    int64_t cap = s->elems_cap;
    if (grow((void **)&p->starts, &s->elems_cap, p->n_elems + 1, 8)) FAIL(s, "out of memory");
    if (cap != s->elems_cap) {          /* the three arrays share one capacity */
        int64_t *e = realloc(p->ends, (size_t)s->elems_cap * 8), *a;
        if (e) p->ends = e;
        a = e ? realloc(p->slots_after, (size_t)s->elems_cap * 8) : NULL;
        if (a) p->slots_after = a;
        if (!e || !a) { s->elems_cap = cap; FAIL(s, "out of memory"); }
    }
    p->starts[p->n_elems] = start; p->ends[p->n_elems] = end; p->slots_after[p->n_elems] = slots_after;
    p->n_elems++;
    return 0;
}

static int add_global(scan_t *s, const uint8_t *mod, int64_t ml, const uint8_t *name, int64_t nl) {
    plan_t *p = s->p;
    for (int64_t i = 0; i < ml + nl; i++) {
        uint8_t c = i < ml ? mod[i] : name[i - ml];
        if (c == '\n' || c == ' ' || c == 0) FAIL(s, "a global's name holds a space, newline or NUL");
    }
    /* already listed? a linear search: a file names few globals (the list is capped at 64 KB) */
    for (int64_t at = 0; at < p->globals_len;) {
        char *eol = memchr(p->globals + at, '\n', (size_t)(p->globals_len - at));
        int64_t len = eol - (p->globals + at);
        if (len == ml + 1 + nl && !memcmp(p->globals + at, mod, (size_t)ml) && p->globals[at + ml] == ' '
            && !memcmp(p->globals + at + ml + 1, name, (size_t)nl)) return 0;
        at += len + 1;
    }
    if (p->globals_len + ml + nl + 2 > 65536) FAIL(s, "the file names too many globals");
    if (grow((void **)&p->globals, &s->globals_cap, p->globals_len + ml + nl + 2, 1)) FAIL(s, "out of memory");
    memcpy(p->globals + p->globals_len, mod, (size_t)ml);
    p->globals[p->globals_len + ml] = ' ';
    memcpy(p->globals + p->globals_len + ml + 1, name, (size_t)nl);
    p->globals[p->globals_len + ml + 1 + nl] = '\n';
    p->globals_len += ml + nl + 2;
    return 0;
}

/* a memo write: the next free slot, or one rewritten, as every pickler writes them */
static int memo_put(scan_t *s, int64_t key) {
    plan_t *p = s->p;
    if (s->depth == level_base(s)) FAIL(s, "a memo write with nothing on the stack");
    if (key < 0 || key > p->n_slots) FAIL(s, "a memo slot written out of order");
    if (key == p->n_slots) {
        int64_t cap = s->slots_cap;
        if (grow((void **)&p->last_read, &s->slots_cap, key + 1, 8)) FAIL(s, "out of memory");
        if (cap != s->slots_cap) {
            int64_t *o = realloc(s->str, (size_t)s->slots_cap * 8);
            if (!o) { s->slots_cap = cap; FAIL(s, "out of memory"); }
            s->str = o;
        }
        p->last_read[key] = -1;
        p->n_slots++;
    }
    item_t *top = &s->stack[s->depth - 1];
    s->str[key] = top->str;
    if (key == s->list_slot) s->list_slot = -1;            /* rewritten: no longer the list */
    if (s->depth == 1 && !s->n_marks) {                      /* the top list itself */
        if (s->list_slot >= 0 || p->n_elems) FAIL(s, "the top list is memoized twice");
        s->list_slot = key;
        p->prefix_end = s->pos;
    }
    return 0;
}

static int memo_get(scan_t *s, int64_t key, int64_t at) {
    if (key < 0 || key >= s->p->n_slots) FAIL(s, "a memo slot read before it is written");
    if (key == s->list_slot) FAIL(s, "an element reads its own list");
    s->p->last_read[key] = at;
    return push(s, at, s->p->n_slots, s->str[key]);
}

/* little-endian unsigned integer of n bytes, after checking they are in the file */
static int read_uint(scan_t *s, int n, uint64_t *out) {
    if (s->size - s->pos < n) FAIL(s, "the file ends inside an opcode");
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | s->buf[s->pos + i];
    s->pos += n;
    *out = v;
    return 0;
}

static int read_line(scan_t *s, const uint8_t **text, int64_t *len) {
    const uint8_t *nl = memchr(s->buf + s->pos, '\n', (size_t)(s->size - s->pos));
    if (!nl) FAIL(s, "the file ends inside an opcode");
    *text = s->buf + s->pos; *len = nl - *text;
    s->pos += *len + 1;
    return 0;
}

static int64_t parse_index(const uint8_t *t, int64_t len) {  /* a PUT/GET line: digits only, else -1 */
    int64_t v = 0;
    if (len <= 0 || len > 12) return -1;
    for (int64_t i = 0; i < len; i++) {
        if (t[i] < '0' || t[i] > '9') return -1;
        v = v * 10 + (t[i] - '0');
    }
    return v;
}

/* the top batch's APPENDS: each item between its MARK and here is an element */
static int close_batch(scan_t *s, int64_t at) {
    for (int64_t k = 1; k < s->depth; k++) {
        int last = k + 1 == s->depth;
        if (add_element(s, s->stack[k].start, last ? at : s->stack[k + 1].start,
                        last ? s->p->n_slots : s->stack[k + 1].slots)) return -1;
    }
    s->elem_start = -1;
    s->depth = 1; s->n_marks = 0;
    return 0;
}

/* one opcode at s->pos; 1 at STOP, 0 to go on, -1 when the file is not planned */
static int step(scan_t *s) {
    if (s->pos >= s->size) FAIL(s, "the file ends inside a pickle");
    int64_t at = s->pos, len, slots = s->p->n_slots;
    uint8_t op = s->buf[s->pos++];
    uint64_t n = 0; const uint8_t *t, *t2;
    item_t first = {at, slots, -1};
    int bottom = !s->n_marks;           /* no MARK open: the top list, and at most one element above it */
    if (bottom && s->depth == 0 && op != 0x80 && op != 0x95 && op != ']' && op != '(')
        FAIL(s, "the top object is not a list");
    switch (op) {                       /* the argument: read, its length checked */
    case 'N': case 0x88: case 0x89: case '}': case ']': case ')': case 0x8f: case '(': case '.': case '0':
    case '1': case '2': case 'R': case 'a': case 'b': case 'd': case 'e': case 'l': case 'o': case 's':
    case 't': case 'u': case 0x81: case 0x85: case 0x86: case 0x87: case 0x90: case 0x91: case 0x92:
    case 0x93: case 0x94:
        break;
    case 'K': case 'h': case 'q': case 'C': case 'U': case 0x8a: case 0x8c: case 0x80:
        if (read_uint(s, 1, &n)) return -1;
        break;
    case 'M':
        if (read_uint(s, 2, &n)) return -1;
        break;
    case 'J': case 'j': case 'r': case 'B': case 'X': case 'T': case 0x8b:
        if (read_uint(s, 4, &n)) return -1;
        break;
    case 'G': case 0x8d: case 0x8e: case 0x96: case 0x95:
        if (read_uint(s, 8, &n)) return -1;
        break;
    case 'F': case 'I': case 'L': case 'S': case 'V': case 'g': case 'p':
        if (read_line(s, &t, &len)) return -1;
        n = (uint64_t)parse_index(t, len);
        break;
    case 'c': case 'i':                 /* GLOBAL, INST: module and name, one line each */
        if (read_line(s, &t, &len) || read_line(s, &t2, (int64_t *)&n)) return -1;
        if (add_global(s, t, len, t2, (int64_t)n)) return -1;
        break;
    case 'P': case 'Q': FAIL(s, "a persistent id");
    case 0x82: case 0x83: case 0x84: FAIL(s, "an extension code");
    case 0x97: case 0x98: FAIL(s, "an out-of-band buffer");
    default: FAIL(s, "a byte that is no pickle opcode");
    }
    switch (op) {                       /* counted strings and bytes: skipped, after checking the file holds them */
    case 'C': case 'U': case 0x8a: case 0x8c: case 'B': case 'X': case 'T': case 0x8b: case 0x8d: case 0x8e:
    case 0x96: {
        if ((op == 'T' || op == 0x8b) && n >= 0x80000000u) FAIL(s, "a negative length");
        if (n > (uint64_t)(s->size - s->pos)) FAIL(s, "a length past the file's end");
        int str = (op == 0x8c || op == 'X' || op == 0x8d) && n <= 4096;   /* may name a global */
        int64_t off = s->pos;
        s->pos += (int64_t)n;
        return push(s, at, slots, str ? STR(off, (int64_t)n) : -1);
    }
    case 0x80: s->p->protocol = (int)n; return 0;          /* PROTO */
    case 0x95:                                              /* FRAME: its 9 bytes are left out when fed */
        if (n > (uint64_t)(s->size - s->pos)) FAIL(s, "a frame past the file's end");
        if (grow((void **)&s->p->frames, &s->frames_cap, s->p->n_frames + 1, 8)) FAIL(s, "out of memory");
        s->p->frames[s->p->n_frames++] = at;
        return 0;
    case 'q': case 'r': case 0x94: case 'p':                /* memo writes */
        return memo_put(s, op == 0x94 ? s->p->n_slots : (int64_t)n);
    case 'h': case 'j': case 'g':                           /* memo reads */
        return memo_get(s, (int64_t)n, at);
    case '(':                                               /* MARK */
        if (s->n_marks + 1 > s->marks_cap) {                /* three arrays of one capacity */
            int64_t cap = s->marks_cap;
            if (grow((void **)&s->marks, &s->marks_cap, s->n_marks + 1, 8)) FAIL(s, "out of memory");
            int64_t *a = realloc(s->mark_at, (size_t)s->marks_cap * 8), *b;
            if (a) s->mark_at = a;
            b = a ? realloc(s->mark_slots, (size_t)s->marks_cap * 8) : NULL;
            if (b) s->mark_slots = b;
            if (!a || !b) { s->marks_cap = cap; FAIL(s, "out of memory"); }
        }
        if (bottom && s->depth == 1 && s->elem_start < 0) s->elem_start = at;
        s->marks[s->n_marks] = s->depth; s->mark_at[s->n_marks] = at; s->mark_slots[s->n_marks] = slots;
        s->n_marks++;
        return 0;
    case '.':                                               /* STOP */
        if (s->n_marks || s->depth != 1) FAIL(s, "STOP with other than one object on the stack");
        s->p->end = s->pos;
        return 1;
    case 'a':                                               /* APPEND */
        if (bottom && s->depth == 2) {                      /* to the top list: one element */
            if (add_element(s, s->elem_start, at, slots)) return -1;
            s->elem_start = -1; s->depth = 1;
            return 0;
        }
        if (s->depth - level_base(s) < 2) FAIL(s, "an opcode needs more items than the stack holds");
        s->depth--;
        return 0;
    case 'e': case 'u': case 0x90:                          /* APPENDS, SETITEMS, ADDITEMS */
        if (s->n_marks == 1 && s->marks[0] == 1 && op == 'e') return close_batch(s, at);
        if (pop_mark(s, &first)) return -1;
        if (s->depth - level_base(s) < 1) FAIL(s, "an opcode needs more items than the stack holds");
        if (!s->n_marks && s->depth <= 1) FAIL(s, "items added to the top list outside a batch");
        return 0;
    }
    int64_t pops = 0, pushes = 1;       /* the rest: pop items (or a MARK's), push one (or none, or two) */
    switch (op) {
    case 'R': case 'b': case 0x81: case 0x86: case 0x93: pops = 2; break;
    case 's': case 0x92: case 0x87: pops = 3; break;
    case 0x85: pops = 1; break;
    case '2':                                               /* DUP: never written by a pickler */
        if (s->n_marks <= 1) FAIL(s, "DUP of the top list or an element");
        pops = 1; pushes = 2; break;
    case '0':                                               /* POP: an item, or the MARK of an empty level */
        pushes = 0;
        if (s->n_marks && s->depth == level_base(s)) { if (pop_mark(s, &first)) return -1; break; }
        pops = 1; break;
    case '1': pushes = 0; if (pop_mark(s, &first)) return -1; break;  /* POP_MARK */
    case 'd': case 'l': case 't': case 0x91: case 'o': case 'i':     /* built from the items above a MARK */
        if (pop_mark(s, &first)) return -1;
        if (!s->n_marks && s->depth == 0) {                 /* protocols 0-1: MARK LIST, the empty top list */
            if (op != 'l' || first.start != at - 1 || s->list_slot != -2) FAIL(s, "the top object is not a list");
            s->list_slot = -1; s->p->prefix_end = s->pos;
        }
        break;
    case ']':
        if (bottom && s->depth == 0) {
            if (s->list_slot != -2) FAIL(s, "a second top object");
            s->list_slot = -1; s->p->prefix_end = s->pos;
        }
        break;
    }
    if (op == 0x93) {                                       /* STACK_GLOBAL: the two strings below */
        if (s->depth - level_base(s) < 2) FAIL(s, "an opcode needs more items than the stack holds");
        item_t *m = &s->stack[s->depth - 2], *q = &s->stack[s->depth - 1];
        if (m->str < 0 || q->str < 0) FAIL(s, "STACK_GLOBAL of other than two strings");
        if (add_global(s, s->buf + (m->str >> 13), m->str & 8191, s->buf + (q->str >> 13), q->str & 8191)) return -1;
    }
    if (pops && pop(s, pops, &first)) return -1;
    if (!s->n_marks && s->depth < 1 && (pops || op == '0' || op == '1') ) FAIL(s, "an opcode takes the top list");
    for (int64_t k = 0; k < pushes; k++)
        if (push(s, first.start, first.slots, -1)) return -1;
    return 0;
}

/* Scan the pickle at the start of buf[0:size]: 0 when planned (see plan_t), 1 otherwise (plan->reason).
 * `release`: buf is a shared map of a file, whose pages behind the scan are handed back every 256 KB
 * (MADV_DONTNEED: they stay in the page cache, out of this process's resident memory; a later read
 * maps them again), so scanning a 2 GB file does not hold 2 GB. Never pass it for other memory. */
int nblib_scan_list(const uint8_t *buf, int64_t size, plan_t *plan, int release) {
    memset(plan, 0, sizeof(*plan));
    scan_t s = {0};
    s.buf = buf; s.size = size; s.p = plan; s.list_slot = -2; s.elem_start = -1;
    /* a page fault maps its neighbours too (the kernel's fault-around, 64 KB), behind the scan as well:
     * each release starts 1 MB before the last one ended */
    int64_t page = sysconf(_SC_PAGESIZE), released = 0, window = 256 << 10, back = 1 << 20;
    int r;
    while ((r = step(&s)) == 0) {
        if (release && s.pos - released >= window + page) {
            int64_t upto = (s.pos - page) / page * page, from = released > back ? released - back : 0;
            madvise((void *)(buf + from), (size_t)(upto - from), MADV_DONTNEED);
            released = upto;
        }
    }
    if (release) madvise((void *)buf, (size_t)size, MADV_DONTNEED);
    free(s.stack); free(s.marks); free(s.mark_at); free(s.mark_slots); free(s.str);
    plan->status = r == 1 ? 0 : 1;
    return plan->status;
}

void nblib_plan_free(plan_t *p) {
    free(p->starts); free(p->ends); free(p->slots_after); free(p->last_read); free(p->frames); free(p->globals);
    memset(p, 0, sizeof(*p));
}
