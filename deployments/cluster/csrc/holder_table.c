/* The KV index's holder table (deployments/cluster/holders.py has the contract and the
 * reference implementation in Python): per block hash, the mask of the replicas holding it,
 * and a prompt's walk over it.
 *
 * Why not a dict of bytes to int: a prompt's walk is one probe per block, and at 100k-token
 * prompts (6,000 blocks) on an index of a million entries each probe of a dict misses the
 * cache three or four times (its slot, the key's bytes, the mask's int object). Here a slot
 * holds its key and mask inline (64 bytes at 128 replicas: one cache line), the walk
 * prefetches the slots of the blocks ahead of it, and masks are and-ed as machine words.
 *
 * Keys are compared whole: up to KEY_BYTES inline (a block hash is a 32-byte sha256 digest);
 * a longer key lives in a dict beside the table (`overflow`), exact as well.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "masks.h"

#define KEY_BYTES 32
#define EMPTY 0u
#define DELETED 1u
#define PREFETCH_AHEAD 8
#define HUGE_PAGE ((size_t)2 << 20)

typedef struct {
    uint64_t hash; /* EMPTY, DELETED, or the key's hash (never 0 or 1) */
    uint64_t len;  /* the key's length (<= KEY_BYTES) */
    unsigned char key[KEY_BYTES];
    uint64_t mask[]; /* `words` of them */
} Slot;

typedef struct {
    PyObject_HEAD
    unsigned char *slots; /* capacity slots of slot_size bytes */
    Py_ssize_t capacity;  /* a power of two, or 0 */
    Py_ssize_t live;      /* slots holding a key */
    Py_ssize_t taken;     /* live and deleted slots (probes go past both) */
    Py_ssize_t words;     /* mask words per slot */
    PyObject *overflow;   /* longer keys: dict of bytes -> int mask */
} HolderTable;

/* Zeroed room for the slots: aligned to a cache line (at 128 replicas a slot is 64 bytes:
 * one line, not two), and a large table on 2 MiB pages where the kernel gives them on request
 * (a walk's probes land on random pages: with 4 KiB pages each probe of a big table missed
 * the TLB too; a 512-block walk on a million entries took 110 us, 35 us on 2 MiB pages). */
static unsigned char *slots_alloc(size_t size) {
    size_t align = size >= HUGE_PAGE ? HUGE_PAGE : 64;
    void *p = NULL;
    if (posix_memalign(&p, align, size) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    if (align == HUGE_PAGE) madvise(p, size, MADV_HUGEPAGE); /* a hint: fine if refused */
#endif
    memset(p, 0, size);
    return p;
}

static size_t slot_size(Py_ssize_t words) { return sizeof(Slot) + (size_t)words * 8; }

static Slot *slot_at(HolderTable *t, Py_ssize_t i) {
    return (Slot *)(t->slots + (size_t)i * slot_size(t->words));
}

static uint64_t key_hash(PyObject *key) {
    Py_hash_t h = PyObject_Hash(key); /* cached in the bytes object */
    uint64_t u = (uint64_t)h;
    return u < 2 ? u + 2 : u;
}

/* The live slot of `key`, or NULL; with `insert`, the slot a new key would take (the first
 * deleted one on its probe path, else the empty one ending it). */
static Slot *probe(HolderTable *t, uint64_t h, const char *key, Py_ssize_t len, Slot **insert) {
    Py_ssize_t mask = t->capacity - 1, i = (Py_ssize_t)(h & (uint64_t)mask);
    Slot *first_free = NULL;
    for (;;) {
        Slot *s = slot_at(t, i);
        if (s->hash == EMPTY) {
            if (insert) *insert = first_free ? first_free : s;
            return NULL;
        }
        if (s->hash == DELETED) {
            if (!first_free) first_free = s;
        } else if (s->hash == h && s->len == (uint64_t)len && memcmp(s->key, key, len) == 0) {
            return s;
        }
        i = (i + 1) & mask;
    }
}

/* Rebuild with `capacity` slots of `words` mask words (the live slots only). */
static int rebuild(HolderTable *t, Py_ssize_t capacity, Py_ssize_t words) {
    unsigned char *old = t->slots;
    Py_ssize_t old_capacity = t->capacity, old_words = t->words;
    size_t old_size = slot_size(old_words);
    size_t size = slot_size(words);
    unsigned char *slots =
        (size_t)capacity > SIZE_MAX / size ? NULL : slots_alloc((size_t)capacity * size);
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    t->slots = slots;
    t->capacity = capacity;
    t->words = words;
    t->taken = t->live;
    for (Py_ssize_t i = 0; i < old_capacity; i++) {
        Slot *s = (Slot *)(old + (size_t)i * old_size);
        if (s->hash == EMPTY || s->hash == DELETED) continue;
        Slot *to = NULL;
        probe(t, s->hash, (const char *)s->key, (Py_ssize_t)s->len, &to);
        memcpy(to, s, sizeof(Slot) + (size_t)old_words * 8);
    }
    free(old);
    return 0;
}

static int bit_of(PyObject *arg, Py_ssize_t *bit) {
    *bit = PyLong_AsSsize_t(arg);
    if (*bit == -1 && PyErr_Occurred()) return -1;
    if (*bit < 0 || *bit > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "a replica's bit position is out of range");
        return -1;
    }
    return 0;
}

/* Exact bytes only: a subclass's __hash__ or __eq__ could run Python code (and change the
 * table) in the middle of a walk. */
static int key_of(PyObject *arg, char **key, Py_ssize_t *len) {
    if (!PyBytes_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "a block hash is bytes");
        return -1;
    }
    return PyBytes_AsStringAndSize(arg, key, len);
}

/* The overflow dict's mask of `key` with `bit` set (set) or cleared (!set). */
static int overflow_update(HolderTable *t, PyObject *key, Py_ssize_t bit, int set) {
    PyObject *one = PyLong_FromLong(1), *shift = PyLong_FromSsize_t(bit);
    PyObject *flag = NULL, *old = NULL, *new = NULL, *inverse = NULL;
    int rc = -1, empty;
    if (!one || !shift || !(flag = PyNumber_Lshift(one, shift))) goto done;
    old = PyDict_GetItemWithError(t->overflow, key); /* borrowed */
    if (!old && PyErr_Occurred()) goto done;
    if (set) {
        new = old ? PyNumber_Or(old, flag) : Py_NewRef(flag);
    } else if (old) {
        inverse = PyNumber_Invert(flag);
        new = inverse ? PyNumber_And(old, inverse) : NULL;
    } else {
        rc = 0; /* nothing held */
        goto done;
    }
    if (!new || (empty = PyObject_Not(new)) < 0) goto done;
    rc = empty ? PyDict_DelItem(t->overflow, key) : PyDict_SetItem(t->overflow, key, new);
done:
    Py_XDECREF(one);
    Py_XDECREF(shift);
    Py_XDECREF(flag);
    Py_XDECREF(new);
    Py_XDECREF(inverse);
    return rc;
}

/* Room for one more key and for `bit` in every mask (a rebuild where not). */
static int make_room(HolderTable *t, Py_ssize_t bit) {
    Py_ssize_t words = t->words > bit / 64 ? t->words : bit / 64 + 1;
    Py_ssize_t capacity = t->capacity ? t->capacity : 64;
    int full = (t->taken + 1) * 2 > capacity;
    if (full && (t->live + 1) * 4 > capacity) capacity *= 2; /* else: drop deleted slots */
    if (!full && words == t->words && capacity == t->capacity) return 0;
    return rebuild(t, capacity, words);
}

/* add's and discard's (key, bit). */
static int parse_key_bit(PyObject *args, PyObject **key_obj, char **key, Py_ssize_t *len,
                         Py_ssize_t *bit) {
    PyObject *bit_obj;
    if (!PyArg_ParseTuple(args, "OO", key_obj, &bit_obj)) return -1;
    return key_of(*key_obj, key, len) < 0 || bit_of(bit_obj, bit) < 0 ? -1 : 0;
}

static PyObject *table_add(HolderTable *t, PyObject *args) {
    PyObject *key_obj;
    char *key;
    Py_ssize_t len, bit;
    if (parse_key_bit(args, &key_obj, &key, &len, &bit) < 0) return NULL;
    if (make_room(t, bit) < 0) return NULL;
    if (len > KEY_BYTES) {
        if (overflow_update(t, key_obj, bit, 1) < 0) return NULL;
        Py_RETURN_NONE;
    }
    uint64_t h = key_hash(key_obj);
    Slot *free_slot = NULL, *s = probe(t, h, key, len, &free_slot);
    if (!s) {
        s = free_slot;
        if (s->hash == EMPTY) t->taken++;
        t->live++;
        memset(s, 0, slot_size(t->words));
        s->hash = h;
        s->len = (uint64_t)len;
        memcpy(s->key, key, len);
    }
    s->mask[bit / 64] |= (uint64_t)1 << (bit % 64);
    Py_RETURN_NONE;
}

static PyObject *table_discard(HolderTable *t, PyObject *args) {
    PyObject *key_obj;
    char *key;
    Py_ssize_t len, bit;
    if (parse_key_bit(args, &key_obj, &key, &len, &bit) < 0) return NULL;
    if (len > KEY_BYTES) {
        if (overflow_update(t, key_obj, bit, 0) < 0) return NULL;
        Py_RETURN_NONE;
    }
    if (!t->capacity || bit / 64 >= t->words) Py_RETURN_NONE;
    Slot *s = probe(t, key_hash(key_obj), key, len, NULL);
    if (!s) Py_RETURN_NONE;
    s->mask[bit / 64] &= ~((uint64_t)1 << (bit % 64));
    for (Py_ssize_t w = 0; w < t->words; w++)
        if (s->mask[w]) Py_RETURN_NONE;
    s->hash = DELETED;
    t->live--;
    Py_RETURN_NONE;
}

/* `value`'s low words * 64 bits (the bits of replicas the table knows) into `mask`. */
static int int_to_mask(PyObject *value, uint64_t *mask, Py_ssize_t words) {
    PyObject *rest = Py_NewRef(value), *shift = PyLong_FromLong(64);
    for (Py_ssize_t k = 0; k < words && rest && shift; k++) {
        mask[k] = PyLong_AsUnsignedLongLongMask(rest);
        PyObject *next = mask[k] == (uint64_t)-1 && PyErr_Occurred() ? NULL
                                                                    : PyNumber_Rshift(rest, shift);
        Py_DECREF(rest);
        rest = next;
    }
    int rc = rest && shift ? 0 : -1;
    Py_XDECREF(rest);
    Py_XDECREF(shift);
    return rc;
}

/* The mask of `key` into `out` (zeros where absent). */
static int lookup_mask(HolderTable *t, PyObject *key_obj, uint64_t *out) {
    char *key;
    Py_ssize_t len;
    if (key_of(key_obj, &key, &len) < 0) return -1;
    if (len > KEY_BYTES) {
        PyObject *value = PyDict_GetItemWithError(t->overflow, key_obj);
        if (!value) {
            if (PyErr_Occurred()) return -1;
            memset(out, 0, (size_t)t->words * 8);
            return 0;
        }
        return int_to_mask(value, out, t->words);
    }
    Slot *s = t->capacity ? probe(t, key_hash(key_obj), key, len, NULL) : NULL;
    if (s) memcpy(out, s->mask, (size_t)t->words * 8);
    else memset(out, 0, (size_t)t->words * 8);
    return 0;
}

static PyObject *table_get(HolderTable *t, PyObject *key_obj) {
    uint64_t *mask = PyMem_Calloc((size_t)t->words + 1, 8);
    if (!mask) return PyErr_NoMemory();
    PyObject *result = lookup_mask(t, key_obj, mask) < 0 ? NULL : from_words(mask, t->words);
    PyMem_Free(mask);
    return result;
}

static void prefetch_slot(HolderTable *t, PyObject *key_obj) {
    if (!PyBytes_CheckExact(key_obj) || PyBytes_GET_SIZE(key_obj) > KEY_BYTES) return;
    uint64_t h = key_hash(key_obj);
    __builtin_prefetch(slot_at(t, (Py_ssize_t)(h & (uint64_t)(t->capacity - 1))));
}

static int append_group(PyObject *groups, Py_ssize_t depth, const uint64_t *mask, Py_ssize_t w) {
    PyObject *bits = from_words(mask, w);
    if (!bits) return -1;
    PyObject *group = Py_BuildValue("(nN)", depth, bits);
    if (!group) return -1;
    int rc = PyList_Append(groups, group);
    Py_DECREF(group);
    return rc;
}

/* match(hashes): the replicas holding at least the prompt's first block, by the leading
 * blocks they hold: [(blocks, mask)], fewest blocks first (PrefixIndex.match_masks). */
static PyObject *table_match(HolderTable *t, PyObject *hashes_obj) {
    PyObject *seq = PySequence_Fast(hashes_obj, "block hashes are a sequence");
    if (!seq) return NULL;
    PyObject *groups = PyList_New(0);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), w = t->words;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t *buffer = w ? PyMem_Calloc((size_t)w * 3, 8) : NULL;
    if (w && !buffer) PyErr_NoMemory();
    if (!groups || (w && !buffer)) goto fail;
    if (!w) goto done; /* nothing was ever held */
    uint64_t *alive = buffer, *held = buffer + w, *gone = buffer + 2 * w;
    for (Py_ssize_t k = 0; k < w; k++) alive[k] = ~(uint64_t)0;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) prefetch_slot(t, items[i]);
    Py_ssize_t depth = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) prefetch_slot(t, items[i + PREFETCH_AHEAD]);
        if (lookup_mask(t, items[i], held) < 0) goto fail;
        int narrowed = 0, any = 0;
        for (Py_ssize_t k = 0; k < w; k++) {
            held[k] &= alive[k];
            gone[k] = alive[k] & ~held[k];
            narrowed |= gone[k] != 0;
            any |= held[k] != 0;
        }
        if (narrowed) {
            if (depth && append_group(groups, depth, gone, w) < 0) goto fail;
            if (!any) goto done;
            memcpy(alive, held, (size_t)w * 8);
        }
        depth++;
    }
    if (depth && append_group(groups, depth, alive, w) < 0) goto fail;
done:
    PyMem_Free(buffer);
    Py_DECREF(seq);
    return groups;
fail:
    PyMem_Free(buffer);
    Py_DECREF(seq);
    Py_XDECREF(groups);
    return NULL;
}

static PyObject *table_num_entries(HolderTable *t, PyObject *Py_UNUSED(ignored)) {
    long long entries = 0;
    for (Py_ssize_t i = 0; i < t->capacity; i++) {
        Slot *s = slot_at(t, i);
        if (s->hash == EMPTY || s->hash == DELETED) continue;
        for (Py_ssize_t k = 0; k < t->words; k++) entries += __builtin_popcountll(s->mask[k]);
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(t->overflow, &pos, &key, &value)) {
        PyObject *count = PyObject_CallMethod(value, "bit_count", NULL);
        if (!count) return NULL;
        entries += PyLong_AsLongLong(count);
        Py_DECREF(count);
        if (PyErr_Occurred()) return NULL;
    }
    return PyLong_FromLongLong(entries);
}

static Py_ssize_t table_len(HolderTable *t) { return t->live + PyDict_GET_SIZE(t->overflow); }

static PyObject *table_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "HolderTable() takes no arguments");
        return NULL;
    }
    HolderTable *t = (HolderTable *)type->tp_alloc(type, 0);
    if (!t) return NULL;
    t->overflow = PyDict_New();
    if (!t->overflow) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void table_dealloc(HolderTable *t) {
    free(t->slots);
    Py_XDECREF(t->overflow);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef table_methods[] = {
    {"add", (PyCFunction)table_add, METH_VARARGS, "add(key, bit): the replica of `bit` holds key."},
    {"discard", (PyCFunction)table_discard, METH_VARARGS, "discard(key, bit): it no longer does."},
    {"get", (PyCFunction)table_get, METH_O, "get(key): the mask of the replicas holding key."},
    {"match", (PyCFunction)table_match, METH_O, "match(hashes): [(blocks, mask)]."},
    {"num_entries", (PyCFunction)table_num_entries, METH_NOARGS, "(key, replica) pairs held."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods table_as_sequence = {.sq_length = (lenfunc)table_len};

static PyTypeObject HolderTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pdserve_holder_table.HolderTable",
    .tp_basicsize = sizeof(HolderTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Per block hash, the mask of the replicas holding it.",
    .tp_new = table_new,
    .tp_dealloc = (destructor)table_dealloc,
    .tp_methods = table_methods,
    .tp_as_sequence = &table_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pdserve_holder_table", NULL, -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_pdserve_holder_table(void) {
    if (PyType_Ready(&HolderTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&HolderTableType);
    if (PyModule_AddObject(m, "HolderTable", (PyObject *)&HolderTableType) < 0) {
        Py_DECREF(&HolderTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
