/* The KV index's holder table (deployments/cluster/holders.py has the contract and the
 * reference implementation in Python): per block hash, the mask of the replicas holding it,
 * and a prompt's walk over it.
 *
 * Why not a dict of bytes to int: a prompt's walk is one lookup per block, and at 100k-token
 * prompts (6,000 blocks) on an index of a million entries each lookup of a dict misses the
 * cache three or four times (its slot, the key's bytes, the mask's int object). Here an entry
 * holds its key and mask inline (64 bytes at 128 replicas: one cache line), entries sit in the
 * order their prompts stored them (holder_store.h: a walk reads the next entry first, and
 * most blocks need no probe), and masks are and-ed as machine words.
 *
 * Keys are compared whole: up to KEY_BYTES inline (a block hash is a 32-byte sha256 digest);
 * a longer key lives in a dict beside the table (`overflow`), exact as well.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "holder_store.h"
#include "masks.h"

#define FOLLOW_AHEAD 4 /* entries prefetched ahead of a walk following the arena */
/* A walk probing the index prefetches slots this far ahead and, from those, entries half
 * as far (keys not stored in the order walked, e.g. a block stored again after an eviction
 * while other replicas held its neighbours: a probe costs two misses, the slot and the entry;
 * 8, 16 and 32 measured alike on a cold walk of random keys). */
#define PROBE_AHEAD 8

typedef struct {
    PyObject_HEAD
    Store store;
    PyObject *overflow; /* longer keys: dict of bytes -> int mask */
    /* A walk's blocks found at the entry after the previous one, and by a probe. */
    unsigned long long followed, probed;
} HolderTable;

static uint64_t key_hash(PyObject *key) {
    Py_hash_t h = PyObject_Hash(key); /* cached in the bytes object */
    uint64_t u = (uint64_t)h;
    return u < 2 ? u + 2 : u;
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
    if (store_make_room(&t->store, bit / 64) < 0) return PyErr_NoMemory();
    if (len > KEY_BYTES) {
        if (overflow_update(t, key_obj, bit, 1) < 0) return NULL;
        Py_RETURN_NONE;
    }
    Entry *e = store_add(&t->store, key_hash(key_obj), key, len);
    e->mask[bit / 64] |= (uint64_t)1 << (bit % 64);
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
    store_discard(&t->store, key_hash(key_obj), key, len, bit);
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

/* The entry holding `key` (NULL: none): entry `*next` where that is it (the walk's guess:
 * the entry after the previous block's), else the one the index finds (`*probed` set).
 * `*next` becomes the entry after it (-1: no guess). */
static Entry *find_entry(const Store *s, PyObject *key_obj, const char *key, Py_ssize_t len,
                         Py_ssize_t *next, int *probed) {
    Py_ssize_t at = *next;
    *probed = !(at >= 0 && at < s->used && entry_is(entry_at(s, at), key, len));
    if (*probed) {
        Slot *slot = store_find(s, key_hash(key_obj), key, len, NULL);
        at = slot ? slot_entry(slot) : -1;
    }
    *next = at < 0 ? -1 : at + 1;
    return at < 0 ? NULL : entry_at(s, at);
}

/* The mask of `key` as `words` words into `out` (zeros where absent); `next` and `probed`
 * as find_entry's. Runs no Python code (keys are exact bytes; masks of long keys are ints,
 * which the garbage collector does not track): the table cannot change under a walk. */
static int lookup_mask(HolderTable *t, PyObject *key_obj, uint64_t *out, Py_ssize_t words,
                       Py_ssize_t *next, int *probed) {
    char *key;
    Py_ssize_t len, held = t->store.words < words ? t->store.words : words;
    if (key_of(key_obj, &key, &len) < 0) return -1;
    memset(out, 0, (size_t)words * 8);
    *probed = 1;
    if (len > KEY_BYTES) {
        *next = -1;
        PyObject *value = PyDict_GetItemWithError(t->overflow, key_obj);
        if (!value) return PyErr_Occurred() ? -1 : 0;
        return int_to_mask(value, out, words);
    }
    Entry *e = find_entry(&t->store, key_obj, key, len, next, probed);
    if (e) memcpy(out, e->mask, (size_t)held * 8);
    return 0;
}

static PyObject *table_get(HolderTable *t, PyObject *key_obj) {
    Py_ssize_t words = t->store.words, next = -1;
    int probed;
    uint64_t *mask = PyMem_Calloc((size_t)words + 1, 8);
    if (!mask) return PyErr_NoMemory();
    int rc = lookup_mask(t, key_obj, mask, words, &next, &probed);
    PyObject *result = rc < 0 ? NULL : from_words(mask, words);
    PyMem_Free(mask);
    return result;
}

/* Prefetch the index slot of `key_obj` (entry = 0), or the entry its slot refers to. */
static void prefetch_by_hash(HolderTable *t, PyObject *key_obj, int entry) {
    Store *s = &t->store;
    if (!s->capacity || !PyBytes_CheckExact(key_obj) || PyBytes_GET_SIZE(key_obj) > KEY_BYTES)
        return;
    uint64_t h = key_hash(key_obj); /* cached in the bytes object from then on */
    Slot *slot = &s->slots[h & (uint64_t)(s->capacity - 1)];
    if (!entry) __builtin_prefetch(slot);
    else if (slot->ref >= FIRST_REF && slot->tag == (uint32_t)(h >> 32))
        __builtin_prefetch(entry_at(s, slot_entry(slot)));
}

/* A walk's groups as it finds them: (depth, mask of `w` words) records, made into Python
 * objects once the walk is over (an allocation of a tuple may run the garbage collector, and
 * so finalizers, which could change the table in the middle of a walk). */
typedef struct {
    uint64_t *records; /* `count` of 1 + w words */
    Py_ssize_t count, room, w;
} Groups;

static int groups_add(Groups *g, Py_ssize_t depth, const uint64_t *mask) {
    if (g->count == g->room) {
        Py_ssize_t room = g->room ? g->room * 2 : 8;
        uint64_t *records = PyMem_Realloc(g->records, (size_t)room * (1 + g->w) * 8);
        if (!records) return -1;
        g->records = records;
        g->room = room;
    }
    uint64_t *record = g->records + (size_t)g->count++ * (1 + g->w);
    record[0] = (uint64_t)depth;
    memcpy(record + 1, mask, (size_t)g->w * 8);
    return 0;
}

/* [(blocks, mask)] of the groups recorded. */
static PyObject *groups_list(const Groups *g) {
    PyObject *list = PyList_New(g->count);
    for (Py_ssize_t i = 0; list && i < g->count; i++) {
        const uint64_t *record = g->records + (size_t)i * (1 + g->w);
        PyObject *bits = from_words(record + 1, g->w);
        PyObject *group = bits ? Py_BuildValue("(nN)", (Py_ssize_t)record[0], bits) : NULL;
        if (!group) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, group);
    }
    return list;
}

/* One step of a walk: the blocks held by every replica so far (`alive`) narrowed by those
 * holding this block (`held`); the replicas that drop out at `depth` recorded. 1: go on, 0:
 * no replica holds this block, -1: no memory. */
static int narrow(Groups *g, uint64_t *alive, const uint64_t *held, uint64_t *gone,
                  Py_ssize_t depth) {
    int narrowed = 0, any = 0;
    for (Py_ssize_t k = 0; k < g->w; k++) {
        gone[k] = alive[k] & ~held[k];
        narrowed |= gone[k] != 0;
        any |= (alive[k] & held[k]) != 0;
    }
    if (!narrowed) return 1;
    if (depth && groups_add(g, depth, gone) < 0) return -1;
    for (Py_ssize_t k = 0; k < g->w; k++) alive[k] &= held[k];
    return any;
}

/* match(hashes): the replicas holding at least the prompt's first block, by the leading
 * blocks they hold: [(blocks, mask)], fewest blocks first (PrefixIndex.match_masks). */
static PyObject *table_match(HolderTable *t, PyObject *hashes_obj) {
    PyObject *seq = PySequence_Fast(hashes_obj, "block hashes are a sequence");
    if (!seq) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), w = t->store.words;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Groups g = {NULL, 0, 0, w};
    uint64_t *buffer = PyMem_Calloc((size_t)w * 3 + 1, 8);
    if (!buffer) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *alive = buffer, *held = buffer + w, *gone = buffer + 2 * w;
    for (Py_ssize_t k = 0; k < w; k++) alive[k] = ~(uint64_t)0;
    Py_ssize_t depth = 0, next = -1;
    int go_on = w > 0, probed; /* (no words: nothing was ever held) */
    for (Py_ssize_t i = 0; i < n && go_on; i++) {
        if (lookup_mask(t, items[i], held, w, &next, &probed) < 0) goto done;
        if (probed) { /* not where the arena's order said: probing */
            t->probed++;
            if (i + PROBE_AHEAD < n) prefetch_by_hash(t, items[i + PROBE_AHEAD], 0);
            if (i + PROBE_AHEAD / 2 < n) prefetch_by_hash(t, items[i + PROBE_AHEAD / 2], 1);
        } else {
            t->followed++;
            if (next + FOLLOW_AHEAD < t->store.used)
                __builtin_prefetch(entry_at(&t->store, next + FOLLOW_AHEAD));
        }
        go_on = narrow(&g, alive, held, gone, depth);
        if (go_on < 0) {
            PyErr_NoMemory();
            goto done;
        }
        depth += go_on;
    }
    if (go_on && depth && groups_add(&g, depth, alive) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = groups_list(&g);
done:
    PyMem_Free(buffer);
    PyMem_Free(g.records);
    Py_DECREF(seq);
    return result;
}

static PyObject *table_num_entries(HolderTable *t, PyObject *Py_UNUSED(ignored)) {
    long long entries = 0;
    Store *s = &t->store;
    for (Py_ssize_t i = 0; i < s->used; i++) {
        Entry *e = entry_at(s, i);
        if (e->hash == FREE) continue;
        for (Py_ssize_t k = 0; k < s->words; k++) entries += __builtin_popcountll(e->mask[k]);
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

static PyObject *table_walk_counts(HolderTable *t, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("(KK)", t->followed, t->probed);
}

static Py_ssize_t table_len(HolderTable *t) {
    return t->store.live + PyDict_GET_SIZE(t->overflow);
}

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
    store_clear(&t->store);
    Py_XDECREF(t->overflow);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef table_methods[] = {
    {"add", (PyCFunction)table_add, METH_VARARGS, "add(key, bit): the replica of `bit` holds key."},
    {"discard", (PyCFunction)table_discard, METH_VARARGS, "discard(key, bit): it no longer does."},
    {"get", (PyCFunction)table_get, METH_O, "get(key): the mask of the replicas holding key."},
    {"match", (PyCFunction)table_match, METH_O, "match(hashes): [(blocks, mask)]."},
    {"num_entries", (PyCFunction)table_num_entries, METH_NOARGS, "(key, replica) pairs held."},
    {"walk_counts", (PyCFunction)table_walk_counts, METH_NOARGS,
     "(followed, probed): walks' blocks found next to the previous one, and by a probe."},
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
