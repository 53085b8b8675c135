/* The holder table's storage (holder_table.c is its Python face): per block hash an entry
 * holding its key and replica mask inline, kept in an arena in the order the keys were first
 * added, and an open-addressing index from the key's hash to its entry.
 *
 * Why an arena in insertion order: a walk's blocks are a prompt's chained hashes, and an
 * engine stores a prompt's blocks in that order, in one event: their entries sit side by
 * side. A walk tries the entry after the one it just found first and probes the index only
 * where that is not the next block (a turn's new blocks, stored later, or a block stored
 * again after an eviction). One hash table of entries put each block of a walk on a random
 * page: ~80 ns a block where page walks are dear (a virtual machine's nested paging; a
 * 512-block walk took 42 us in `pdserve bench router-sim --trace`). Side by side, the
 * hardware prefetcher streams them, and most blocks need neither a hash nor a probe.
 *
 * Holes (keys no replica holds any more) stay in place until the arena is full; it is then
 * compacted in order (or doubled, where fewer than half are holes), and the index rebuilt.
 */
#ifndef PDSERVE_HOLDER_STORE_H
#define PDSERVE_HOLDER_STORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define KEY_BYTES 32 /* keys up to a sha256 digest inline */
#define EMPTY 0u   /* a slot never used */
#define DELETED 1u /* a slot whose entry was dropped (probes go past it) */
#define FIRST_REF 2u /* a slot's `ref` of entry 0 */
#define MAX_ENTRIES ((Py_ssize_t)UINT32_MAX - FIRST_REF)
#define FREE 0u    /* an entry no replica holds (a hole) */
#define HUGE_PAGE ((size_t)2 << 20)
#define TRACE_DOMAIN 0 /* tracemalloc's default domain: the index's size counts these too */

typedef struct {
    uint64_t hash; /* the key's hash (never 0 or 1), or FREE */
    uint64_t len;  /* the key's length (<= KEY_BYTES) */
    unsigned char key[KEY_BYTES];
    uint64_t mask[]; /* `words` of them */
} Entry;

/* 8 bytes: the index is most of the table's memory after the entries. */
typedef struct {
    uint32_t tag; /* the high half of the entry's key hash (most other keys differ there) */
    uint32_t ref; /* EMPTY, DELETED, or FIRST_REF + the entry's index */
} Slot;

typedef struct {
    unsigned char *entries; /* `room` entries of entry_size(words) bytes */
    Py_ssize_t room, used;  /* used: entries handed out (live ones and holes) */
    Py_ssize_t live;        /* entries holding a key */
    Py_ssize_t words;       /* mask words per entry */
    Slot *slots;            /* `capacity` of them, a power of two (or 0 and NULL) */
    Py_ssize_t capacity, taken; /* taken: slots live or deleted */
} Store;

/* Zeroed room, aligned to a cache line (at 128 replicas an entry is one line, not two), and
 * past 2 MiB on 2 MiB pages where the kernel gives them on request (Linux's default THP mode
 * grants them to madvise only): fewer TLB misses for a probe. Counted by tracemalloc. */
static void *store_alloc(size_t count, size_t size) {
    if (size && count > SIZE_MAX / size) return NULL;
    size *= count;
    size_t align = size >= HUGE_PAGE ? HUGE_PAGE : 64;
    void *p = NULL;
    if (posix_memalign(&p, align, size ? size : 64) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    if (align == HUGE_PAGE) madvise(p, size, MADV_HUGEPAGE); /* a hint: fine if refused */
#endif
    memset(p, 0, size);
    PyTraceMalloc_Track(TRACE_DOMAIN, (uintptr_t)p, size);
    return p;
}

static void store_free(void *p) {
    if (!p) return;
    PyTraceMalloc_Untrack(TRACE_DOMAIN, (uintptr_t)p);
    free(p);
}

static size_t entry_size(Py_ssize_t words) { return sizeof(Entry) + (size_t)words * 8; }

static Entry *entry_at(const Store *s, Py_ssize_t i) {
    return (Entry *)(s->entries + (size_t)i * entry_size(s->words));
}

static int entry_is(const Entry *e, const char *key, Py_ssize_t len) {
    return e->hash != FREE && e->len == (uint64_t)len && memcmp(e->key, key, len) == 0;
}

static Py_ssize_t slot_entry(const Slot *slot) { return (Py_ssize_t)(slot->ref - FIRST_REF); }

static void slot_point(Slot *slot, uint64_t h, Py_ssize_t at) {
    slot->tag = (uint32_t)(h >> 32);
    slot->ref = (uint32_t)at + FIRST_REF;
}

/* The slot of the entry holding `key`, or NULL; with `insert`, the slot a new key would take
 * (the first deleted one on its probe path, else the empty one ending it). */
static Slot *store_find(const Store *s, uint64_t h, const char *key, Py_ssize_t len,
                        Slot **insert) {
    if (!s->capacity) return NULL;
    Py_ssize_t mask = s->capacity - 1, i = (Py_ssize_t)(h & (uint64_t)mask);
    Slot *first_free = NULL;
    uint32_t tag = (uint32_t)(h >> 32);
    for (;; i = (i + 1) & mask) {
        Slot *slot = &s->slots[i];
        if (slot->ref == EMPTY) {
            if (insert) *insert = first_free ? first_free : slot;
            return NULL;
        }
        if (slot->ref == DELETED) {
            if (!first_free) first_free = slot;
        } else if (slot->tag == tag) {
            Entry *e = entry_at(s, slot_entry(slot));
            if (e->hash == h && entry_is(e, key, len)) return slot;
        }
    }
}

/* Point the index (`capacity` empty slots, installed) at every live entry. */
static void slots_fill(Store *s) {
    s->taken = s->live;
    for (Py_ssize_t i = 0; i < s->used; i++) {
        Entry *e = entry_at(s, i);
        if (e->hash == FREE) continue;
        Slot *to = NULL;
        store_find(s, e->hash, (const char *)e->key, (Py_ssize_t)e->len, &to);
        slot_point(to, e->hash, i);
    }
}

static void slots_install(Store *s, Slot *slots, Py_ssize_t capacity) {
    store_free(s->slots);
    s->slots = slots;
    s->capacity = capacity;
}

/* The slots for `live` keys: at most half taken, a quarter live after a rebuild. */
static Py_ssize_t slots_for(Py_ssize_t live) {
    Py_ssize_t capacity = 64;
    while (capacity < live * 4) capacity *= 2;
    return capacity;
}

/* A new index of `capacity` slots over the live entries (-1: no memory, nothing changed). */
static int slots_rebuild(Store *s, Py_ssize_t capacity) {
    Slot *slots = store_alloc((size_t)capacity, sizeof(Slot));
    if (!slots) return -1;
    slots_install(s, slots, capacity);
    slots_fill(s);
    return 0;
}

/* A new arena of `room` entries of `words` mask words, holding the live entries in their
 * order (holes dropped), and the index rebuilt over it. Both are allocated before either is
 * installed: where memory runs out, the table is left as it was (an arena compacted under
 * the old index would leave it pointing at entries that moved). */
static int entries_relayout(Store *s, Py_ssize_t room, Py_ssize_t words) {
    Py_ssize_t capacity = slots_for(s->live);
    unsigned char *entries = store_alloc((size_t)room, entry_size(words));
    Slot *slots = entries ? store_alloc((size_t)capacity, sizeof(Slot)) : NULL;
    if (!slots) {
        store_free(entries);
        return -1;
    }
    Py_ssize_t kept = 0;
    size_t old_size = entry_size(s->words), new_size = entry_size(words);
    for (Py_ssize_t i = 0; i < s->used; i++) {
        Entry *e = entry_at(s, i);
        if (e->hash == FREE) continue;
        memcpy(entries + (size_t)kept++ * new_size, e, old_size); /* wider: zeros after */
    }
    store_free(s->entries);
    s->entries = entries;
    s->room = room;
    s->used = kept;
    s->words = words;
    slots_install(s, slots, capacity);
    slots_fill(s);
    return 0;
}

/* Room for one more key and for mask word `word` in every entry. */
static int store_make_room(Store *s, Py_ssize_t word) {
    Py_ssize_t words = s->words > word ? s->words : word + 1;
    if (words != s->words || s->used == s->room) {
        Py_ssize_t room = s->room ? s->room : 64;
        if (s->used == s->room && s->live * 2 > s->used) room *= 2; /* else: drop the holes */
        if (room > MAX_ENTRIES) return -1; /* (a slot refers to an entry in 32 bits) */
        if (entries_relayout(s, room, words) < 0) return -1;
    }
    if ((s->taken + 1) * 2 > s->capacity) return slots_rebuild(s, slots_for(s->live + 1));
    return 0;
}

/* The entry of `key` (hash `h`), a new one where absent (after store_make_room). */
static Entry *store_add(Store *s, uint64_t h, const char *key, Py_ssize_t len) {
    Slot *insert = NULL, *slot = store_find(s, h, key, len, &insert);
    if (slot) return entry_at(s, slot_entry(slot));
    Entry *e = entry_at(s, s->used);
    memset(e, 0, entry_size(s->words));
    e->hash = h;
    e->len = (uint64_t)len;
    memcpy(e->key, key, len);
    if (insert->ref == EMPTY) s->taken++;
    slot_point(insert, h, s->used++);
    s->live++;
    return e;
}

/* Clear `bit` of `key`'s mask; the key goes (a hole) when no replica holds it. */
static void store_discard(Store *s, uint64_t h, const char *key, Py_ssize_t len, Py_ssize_t bit) {
    Slot *slot = store_find(s, h, key, len, NULL);
    if (!slot || bit / 64 >= s->words) return;
    Entry *e = entry_at(s, slot_entry(slot));
    e->mask[bit / 64] &= ~((uint64_t)1 << (bit % 64));
    for (Py_ssize_t w = 0; w < s->words; w++)
        if (e->mask[w]) return;
    e->hash = FREE;
    slot->ref = DELETED;
    s->live--;
}

static void store_clear(Store *s) {
    store_free(s->entries);
    store_free(s->slots);
    memset(s, 0, sizeof(*s));
}

#endif
