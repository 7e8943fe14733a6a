/* The packed packet store: store.QueueStore's queues with each packet in one malloc'd record.
 *
 * store.py is the reference and says what every rule is; this file keeps the same rules
 * (decisions 1-5, 13-16, 21-22) with a layout that holds no Python object per packet:
 *
 * - Packet: one record per queued packet, key and payload inline after a fixed header (seq,
 *   deadline, prio, lease count, TTL and delay state, its place in the two expiry heaps, its
 *   key group's links). 8-byte key + 16-byte payload: 86 bytes, a 96-byte malloc chunk. A
 *   popped record is kept (a few per size class) for the next push: packet_free.
 * - Queue: a Python object (the store's dict maps names to them), holding
 *   - groups: an open-addressing table (linear probing, backward-shift deletion) from key to
 *     the oldest packet of that key; a key's packets form a circular doubly-linked list in push
 *     order through gnext/gprev, so the oldest's gprev is the newest. A packet is live exactly
 *     while its group holds it, as in store.py. The table doubles past 3/4 full and halves
 *     below 1/8, so a queue that drains gives its room back; from 2 MiB it is on huge pages
 *     (table_calloc).
 *   - levels: per priority 0..255 present, an array of entries in push order (a deque: start,
 *     end); an entry is a packet pointer or, for a packet that left other than from the top
 *     (a sibling taken with its group, an expiry), a tombstone (seq << 1 | 1) that keeps the
 *     seq so bisection by seq still works and a packet coming back from a lease reuses it. The
 *     first and last entries of a level are always live: a pop reads its packet at the end,
 *     and the queue's oldest packet is the oldest first entry. Levels are kept in a small
 *     array sorted by prio, indexed through a 256-bit mask (rank = bits set below prio);
 *     prio 0 has a level too (never selected: it gives push order for the oldest packet).
 *     Once tombstones outnumber live packets (plus slack), the levels are rebuilt: O(1)
 *     amortised, memory O(live).
 *   - qheap: the queue's live TTL packets, a heap by (deadline, seq), for queue_info's next
 *     expiry; delayed: its delayed packets (decision 21), a circular list through gnext/gprev.
 * - the store: one heap of every packet with a TTL deadline or a due time, by (time, seq),
 *   each packet knowing its place (hpos), so a pop removes its entry in O(log t) and nothing
 *   is stale.
 *
 * Packets that leave by pop become tuples (key, payload, prio, seq, deadline, leases): the
 * contract's QueuedPacket, which take/restore hand back and forth. ``pop_reply`` (a pop
 * frame) and ``pop_delivery`` (a plain subscriber's delivery) write the reply's bytes straight
 * into the session's output instead, in one pass over the key group, making no object per
 * packet. ``prefetch_pushes`` lets a batch's pushes ask for their cache lines ahead.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#define STALE_SLACK 64
#define MAX_FIELD 0xFFFF
#define MAX_POP_LIMIT 0xFFFF

/* ---------------------------------------------------------------------------------------- */
/* Records */

struct QueueObject;

typedef struct Packet {
    struct Packet *gnext, *gprev; /* key group (or the delayed list), circular, push order */
    struct QueueObject *queue;
    uint64_t seq;
    double deadline;  /* TTL deadline (INFINITY: none); while delayed, the due time */
    uint32_t hpos;    /* 1 + index in the store's heap; 0: not in it */
    uint32_t qhpos;   /* 1 + index in its queue's heap; 0: not in it */
    uint32_t ttl_ms;  /* kept while delayed: the deadline is due time + TTL */
    uint32_t leases;  /* times leased (decision 13), saturating */
    uint16_t klen, plen;
    uint8_t prio;
    uint8_t flags;
    char data[];      /* key, then payload */
} Packet;

#define F_DELAYED 1
#define F_MARK 2 /* peek's "already listed"; check_invariants' "seen" */

#define KEY(p) ((p)->data)
#define PAYLOAD(p) ((p)->data + (p)->klen)
/* What bytes_held counts for a packet: key, payload and the overhead estimate. */
#define HELD(p) ((int64_t)(p)->klen + (p)->plen + packet_overhead)

/* The bytes_held estimate per packet beyond key and payload: the record's header and malloc
 * chunk rounding, a level entry and a group slot (docs/performance.md measures it). */
#define PACKET_OVERHEAD 112
static const int64_t packet_overhead = PACKET_OVERHEAD;

typedef uintptr_t Entry; /* a Packet pointer, or a tombstone seq << 1 | 1 */
#define IS_TOMB(e) ((e) & 1)
#define TOMB(seq) (((Entry)(seq) << 1) | 1)
#define ENTRY_SEQ(e) (IS_TOMB(e) ? (uint64_t)((e) >> 1) : ((Packet *)(e))->seq)

typedef struct {
    Entry *a;
    uint32_t start, end, cap, stale;
    uint8_t prio;
} Level;

typedef struct {
    Packet **a;
    uint32_t n, cap;
} Heap;

typedef struct QueueObject {
    PyObject_HEAD
    PyObject *name;
    uintptr_t *slots; /* key groups: the oldest packet of each key (a Slot: tagged) */
    uint32_t slot_cap, groups;
    int slots_mapped; /* slots is a huge-page mapping of its own (table_calloc), not PyMem's */
    uint64_t mask[4];
    Level *levels;
    uint16_t nlevels, level_cap;
    int64_t size;    /* live packets, prio 0 included, delayed excluded */
    int64_t bytes;   /* its share of bytes_held, delayed packets included */
    int64_t entries; /* level entries, live or tombstones */
    Heap qheap;
    Packet *delayed_head;
    int64_t delayed, delayed_bytes;
    Packet **dslots; /* its delayed packets by seq (delayed_find), at most half full */
    uint32_t dslot_cap;
} QueueObject;

typedef struct {
    PyObject_HEAD
    PyObject *clock;
    PyObject *queues; /* dict: name -> QueueObject */
    PyObject *arrived; /* list: queues delayed packets entered since take_arrived */
    /* The queue the last lookup found, by the very name object it was looked up with (held):
     * the codec gives a run of frames to one queue one name, so most lookups are a pointer
     * comparison, not a dict lookup. Cleared when that queue leaves the dict. */
    PyObject *last_name;
    QueueObject *last_queue;
    PyObject *dict;
    Py_ssize_t max_pop;
    long long bytes_held, unselectable_bytes, expired, purged, taken_bytes, delayed_bytes;
    long long pushed, held;
    uint64_t seq;
    Heap heap;
    /* The log (attach_log; all NULL for a memory-only store): the journal's open block */
    PyObject *log_pushes, *log_removals; /* bytearrays: push-kind entries, remove entries */
    PyObject *wall_clock;                /* seconds since the epoch, for a move's deadlines */
    PyObject *taken;                     /* dict: leased packets' seq -> the queue they left */
    double block_wall;                   /* the wall clock at the open block's first push */
} StoreObject;

static PyTypeObject QueueType;
static PyTypeObject StoreType;
static PyObject *inf_float; /* the deadline of every packet without a TTL: one object */

/* ---------------------------------------------------------------------------------------- */
/* Hashing keys */

static inline uint64_t hash_key(const char *s, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xff51afd7ed558ccdull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xbf58476d1ce4e5b9ull;
        h ^= h >> 31;
        s += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, s, n);
    h = (h ^ w) * 0x94d049bb133111ebull;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    return h;
}

static inline int key_is(const Packet *p, const char *key, size_t n) {
    return p->klen == n && memcmp(p->data, key, n) == 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Key groups: open addressing from key to the group's oldest packet
 *
 * A slot is the packet's pointer with the low 21 bits of its key's hash in the bits a record's
 * address leaves unused (x86-64 Linux: user addresses are below 2^47, records 16-byte
 * aligned: 17 bits on top, 4 below). A probe passes a slot of another key, and a deletion's
 * backward shift or a growth finds an entry's home without reading its record: at depth 1M,
 * a record read is a cache miss. A table of up to 2^21 slots (1.5M keys) homes a key at its
 * hash's low bits; a larger one at those 21 bits times cap / 2^21, in buckets of that many
 * slots (bucketed linear probing, as full as the table: 3/4 at most), so a queue of 3M keys
 * reads no record either (it read one per entry a backward shift passed, 25% of a pop's time
 * at 3M). Elsewhere slots are plain pointers and those reads happen. */

typedef uintptr_t Slot;
#if defined(__x86_64__) && defined(__linux__)
#define HASH_BITS 21
#define SLOT_OF(p, hash)                                                                    \
    ((Slot)(p) | ((hash) & 15) | ((Slot)(((hash) >> 4) & 0x1FFFF) << 47))
#define SLOT_PACKET(slot) ((Packet *)((slot) & ((((Slot)1 << 47) - 1) & ~(Slot)15)))
#define SLOT_HASH(slot) (((slot) & 15) | (((slot) >> 47) << 4))
#define ADDRESS_FITS(p) ((((uintptr_t)(p)) & 15) == 0 && ((uintptr_t)(p)) >> 47 == 0)
#else
#define HASH_BITS 0
#define SLOT_OF(p, hash) ((Slot)(p))
#define SLOT_PACKET(slot) ((Packet *)(slot))
#define SLOT_HASH(slot) ((Slot)0)
#define ADDRESS_FITS(p) 1
#endif
#define HASH_MASK (((uint64_t)1 << HASH_BITS) - 1)
/* The smallest table a queue has. */
#define MIN_SLOTS 8

/* The home slot of a key of this hash in a table of cap slots (a power of two). */
static inline uint32_t hash_home(uint64_t hash, uint32_t cap) {
    if (!HASH_BITS || cap <= ((uint64_t)1 << HASH_BITS))
        return (uint32_t)hash & (cap - 1);
    return (uint32_t)(hash & HASH_MASK) << (__builtin_ctz(cap) - HASH_BITS);
}

/* Where a slot's entry hashes to in a table of cap slots. */
static inline uint32_t slot_home(Slot slot, uint32_t cap) {
    if (HASH_BITS)
        return hash_home(SLOT_HASH(slot), cap);
    Packet *p = SLOT_PACKET(slot);
    return hash_home(hash_key(KEY(p), p->klen), cap);
}

/* The slot holding key's group, or the empty slot where it would go. */
static inline uint32_t group_slot_hashed(QueueObject *q, const char *key, size_t n,
                                         uint64_t hash) {
    uint32_t mask = q->slot_cap - 1, i = hash_home(hash, q->slot_cap);
    for (;;) {
        Slot slot = q->slots[i];
        if (slot == 0 ||
            (SLOT_HASH(slot) == (hash & HASH_MASK) && key_is(SLOT_PACKET(slot), key, n)))
            return i;
        i = (i + 1) & mask;
    }
}

static inline uint32_t group_slot(QueueObject *q, const char *key, size_t n) {
    return group_slot_hashed(q, key, n, hash_key(key, n));
}

/* The slot holding head, the oldest packet of its group: found by identity, reading no
 * other record. */
static inline uint32_t head_slot_hashed(QueueObject *q, Packet *head, uint64_t hash) {
    uint32_t mask = q->slot_cap - 1;
    uint32_t i = hash_home(hash, q->slot_cap);
    while (SLOT_PACKET(q->slots[i]) != head)
        i = (i + 1) & mask;
    return i;
}

static inline uint32_t head_slot(QueueObject *q, Packet *head) {
    return head_slot_hashed(q, head, hash_key(KEY(head), head->klen));
}

/* The oldest packet of p's key group. */
static inline Packet *group_head(QueueObject *q, Packet *p) {
    return SLOT_PACKET(q->slots[group_slot(q, KEY(p), p->klen)]);
}

/* Big tables on huge pages. A push and a pop each read one slot of the key-group table at
 * random; at depth 1M the table is 16 MiB, 4,096 pages of 4 KiB, so besides a cache miss
 * each read is a TLB miss, and the table's pages push the interpreter's own out of the TLB.
 * A table of HUGE_TABLE bytes or more is therefore a mapping of its own, aligned to 2 MiB and
 * advised MADV_HUGEPAGE (Linux; transparent huge pages' default "madvise" mode gives them
 * only to memory that asks): 8 huge pages at depth 1M. mmap's memory is zeroed, as calloc's.
 * Smaller tables, other systems, or a failed mapping: PyMem_Calloc, as before. */
#define HUGE_PAGE ((size_t)2 << 20)
#define HUGE_TABLE HUGE_PAGE

/* A zeroed table of ``bytes``; *mapped says which way it came (table_free needs it). */
static void *table_calloc(size_t bytes, int *mapped) {
    *mapped = 0;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= HUGE_TABLE && bytes % HUGE_PAGE == 0) {
        /* map a huge page more than asked, then unmap what lies outside the aligned part */
        char *raw = mmap(NULL, bytes + HUGE_PAGE, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw != MAP_FAILED) {
            uintptr_t aligned = ((uintptr_t)raw + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
            char *start = (char *)aligned;
            if (start > raw)
                munmap(raw, (size_t)(start - raw));
            size_t tail = (size_t)(raw + bytes + HUGE_PAGE - (start + bytes));
            if (tail)
                munmap(start + bytes, tail);
            madvise(start, bytes, MADV_HUGEPAGE); /* advice: without THP, plain pages */
            *mapped = 1;
            return start;
        }
    }
#endif
    return PyMem_Calloc(bytes, 1);
}

static void table_free(void *table, size_t bytes, int mapped) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (mapped) {
        munmap(table, bytes);
        return;
    }
#endif
    (void)bytes;
    (void)mapped;
    PyMem_Free(table);
}

/* Rehash the table into cap slots (a power of two, above groups); -1 if out of memory, with
 * the old table kept and no exception set. */
static int groups_resize(QueueObject *q, uint32_t cap) {
    uint32_t old_cap = q->slot_cap;
    Slot *old = q->slots;
    int old_mapped = q->slots_mapped, mapped;
    Slot *slots = table_calloc((size_t)cap * sizeof(Slot), &mapped);
    if (slots == NULL)
        return -1;
    q->slots = slots;
    q->slot_cap = cap;
    q->slots_mapped = mapped;
    for (uint32_t i = 0; i < old_cap; i++) {
        if (old[i] == 0)
            continue;
        uint32_t j = slot_home(old[i], cap);
        while (slots[j] != 0)
            j = (j + 1) & (cap - 1);
        slots[j] = old[i];
    }
    table_free(old, (size_t)old_cap * sizeof(Slot), old_mapped);
    return 0;
}

/* Make room for one more group: the table stays at most 3/4 full. */
static inline int groups_reserve(QueueObject *q) {
    if ((uint64_t)(q->groups + 1) * 4 > (uint64_t)q->slot_cap * 3 &&
        groups_resize(q, q->slot_cap ? q->slot_cap * 2 : MIN_SLOTS) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Give back the room of a queue that drained: below 1/8 full, the table halves (to no fewer
 * than MIN_SLOTS), leaving it under 1/4 full, so a queue hovering around one size does not
 * grow and shrink by turns. O(1) amortised: a halving reads the cap slots, and at least cap/8
 * deletions came since the table last changed size. Out of memory, it stays as it is. */
static inline void groups_release(QueueObject *q) {
    if (q->slot_cap > MIN_SLOTS && (uint64_t)q->groups * 8 < q->slot_cap)
        groups_resize(q, q->slot_cap / 2);
}

/* Empty slot i, shifting back the entries after it that probed past it. */
static void groups_delete_slot(QueueObject *q, uint32_t i) {
    uint32_t mask = q->slot_cap - 1;
    uint32_t j = i;
    q->slots[i] = 0;
    q->groups--;
    for (;;) {
        j = (j + 1) & mask;
        Slot slot = q->slots[j];
        if (slot == 0)
            return;
        uint32_t home = slot_home(slot, q->slot_cap);
        /* the entry may move to i if i lies cyclically in [home, j) */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            q->slots[i] = slot;
            q->slots[j] = 0;
            i = j;
        }
    }
}

/* Empty slot i (the last packet of its group left), giving back room if the table drained. */
static void groups_delete(QueueObject *q, uint32_t i) {
    groups_delete_slot(q, i);
    groups_release(q);
}

/* Delayed packets by seq. A delayed packet is in no key group, so finding one by its seq
 * (locate, which compaction asks of every packet it reads) would walk the queue's delayed
 * ring: 88 us a lookup with 20,000 delayed. This table of record pointers (open addressing,
 * linear probing, at most half full, halved below 1/8) answers in a probe or two. */
#define MIN_DSLOTS 8

static inline uint32_t seq_home(uint64_t seq, uint32_t cap) {
    return (uint32_t)((seq * 0x9E3779B97F4A7C15ull) >> 32) & (cap - 1);
}

static int dslots_resize(QueueObject *q, uint32_t cap) {
    Packet **slots = PyMem_Calloc(cap, sizeof(Packet *));
    if (slots == NULL)
        return -1;
    for (uint32_t i = 0; i < q->dslot_cap; i++) {
        Packet *p = q->dslots[i];
        if (p == NULL)
            continue;
        uint32_t j = seq_home(p->seq, cap);
        while (slots[j] != NULL)
            j = (j + 1) & (cap - 1);
        slots[j] = p;
    }
    PyMem_Free(q->dslots);
    q->dslots = slots;
    q->dslot_cap = cap;
    return 0;
}

/* Index p, about to join q's delayed packets (q->delayed counts those before it); -1 if out
 * of memory, with nothing changed. */
static int delayed_index(QueueObject *q, Packet *p) {
    if ((uint64_t)(q->delayed + 1) * 2 > q->dslot_cap &&
        dslots_resize(q, q->dslot_cap ? q->dslot_cap * 2 : MIN_DSLOTS) < 0)
        return -1;
    uint32_t mask = q->dslot_cap - 1, i = seq_home(p->seq, q->dslot_cap);
    while (q->dslots[i] != NULL)
        i = (i + 1) & mask;
    q->dslots[i] = p;
    return 0;
}

/* Take p, leaving q's delayed packets (q->delayed still counts it), out of the index. */
static void delayed_unindex(QueueObject *q, Packet *p) {
    uint32_t mask = q->dslot_cap - 1, i = seq_home(p->seq, q->dslot_cap);
    while (q->dslots[i] != p)
        i = (i + 1) & mask;
    q->dslots[i] = NULL;
    for (uint32_t j = (i + 1) & mask; q->dslots[j] != NULL; j = (j + 1) & mask) {
        uint32_t home = seq_home(q->dslots[j]->seq, q->dslot_cap);
        if (((j - home) & mask) >= ((j - i) & mask)) { /* it may move back to i */
            q->dslots[i] = q->dslots[j];
            q->dslots[j] = NULL;
            i = j;
        }
    }
    if (q->dslot_cap > MIN_DSLOTS && (uint64_t)(q->delayed - 1) * 8 < q->dslot_cap)
        dslots_resize(q, q->dslot_cap / 2); /* out of memory, it stays as it is */
}

/* q's delayed packet seq, or NULL. */
static Packet *delayed_find(const QueueObject *q, uint64_t seq) {
    if (q->dslots == NULL)
        return NULL;
    uint32_t mask = q->dslot_cap - 1;
    for (uint32_t i = seq_home(seq, q->dslot_cap); q->dslots[i] != NULL; i = (i + 1) & mask)
        if (q->dslots[i]->seq == seq)
            return q->dslots[i];
    return NULL;
}

/* Circular lists through gnext/gprev: a key group, or a queue's delayed packets. */
static inline void ring_insert_after(Packet *at, Packet *p) {
    p->gprev = at;
    p->gnext = at->gnext;
    at->gnext->gprev = p;
    at->gnext = p;
}

static inline void ring_unlink(Packet *p) {
    p->gprev->gnext = p->gnext;
    p->gnext->gprev = p->gprev;
    p->gnext = p->gprev = p;
}

/* File p in its key group, in push order (its seq may be older than the group's newest).
 * The table must have room (groups_reserve). */
static void group_add(QueueObject *q, Packet *p) {
    uint64_t hash = hash_key(KEY(p), p->klen);
    uint32_t i = group_slot_hashed(q, KEY(p), p->klen, hash);
    if (q->slots[i] == 0) {
        p->gnext = p->gprev = p;
        q->slots[i] = SLOT_OF(p, hash);
        q->groups++;
        return;
    }
    Packet *head = SLOT_PACKET(q->slots[i]);
    Packet *at = head->gprev; /* the newest */
    while (at->seq > p->seq && at != head)
        at = at->gprev;
    if (at->seq > p->seq) { /* older than the whole group: the new head */
        ring_insert_after(head->gprev, p);
        q->slots[i] = SLOT_OF(p, hash);
    } else {
        ring_insert_after(at, p);
    }
}

/* Take p out of its key group: what removes a packet. Only a group's oldest packet is in the
 * table; the others leave their ring and touch no slot. */
static void group_remove(QueueObject *q, Packet *p) {
    if (p->gnext == p) {
        groups_delete(q, head_slot(q, p));
        return;
    }
    if (p->gprev->seq > p->seq) { /* the oldest: its ring's previous is the newest */
        uint32_t i = head_slot(q, p);
        q->slots[i] = SLOT_OF(p->gnext, hash_key(KEY(p), p->klen));
    }
    ring_unlink(p);
}

/* ---------------------------------------------------------------------------------------- */
/* Heaps by (time, seq), each packet knowing its place */

static inline uint32_t *heap_pos(Packet *p, int queue_heap) {
    return queue_heap ? &p->qhpos : &p->hpos;
}

static inline int earlier(const Packet *a, const Packet *b) {
    return a->deadline < b->deadline || (a->deadline == b->deadline && a->seq < b->seq);
}

static void heap_set(Heap *h, uint32_t i, Packet *p, int qh) {
    h->a[i] = p;
    *heap_pos(p, qh) = i + 1;
}

static void heap_up(Heap *h, uint32_t i, int qh) {
    Packet *p = h->a[i];
    while (i > 0) {
        uint32_t parent = (i - 1) / 2;
        if (!earlier(p, h->a[parent]))
            break;
        heap_set(h, i, h->a[parent], qh);
        i = parent;
    }
    heap_set(h, i, p, qh);
}

static void heap_down(Heap *h, uint32_t i, int qh) {
    Packet *p = h->a[i];
    for (;;) {
        uint32_t child = 2 * i + 1;
        if (child >= h->n)
            break;
        if (child + 1 < h->n && earlier(h->a[child + 1], h->a[child]))
            child++;
        if (!earlier(h->a[child], p))
            break;
        heap_set(h, i, h->a[child], qh);
        i = child;
    }
    heap_set(h, i, p, qh);
}

static int heap_push(Heap *h, Packet *p, int qh) {
    if (h->n == h->cap) {
        uint32_t cap = h->cap ? h->cap + h->cap / 2 + 4 : 4;
        Packet **a = PyMem_Realloc(h->a, cap * sizeof(Packet *));
        if (a == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        h->a = a;
        h->cap = cap;
    }
    h->a[h->n++] = p;
    heap_up(h, h->n - 1, qh);
    return 0;
}

static void heap_remove(Heap *h, Packet *p, int qh) {
    uint32_t *pos = heap_pos(p, qh);
    uint32_t i = *pos - 1;
    *pos = 0;
    Packet *last = h->a[--h->n];
    if (i < h->n) {
        h->a[i] = last;
        if (i > 0 && earlier(last, h->a[(i - 1) / 2]))
            heap_up(h, i, qh);
        else
            heap_down(h, i, qh);
    }
    if (h->n == 0) {
        PyMem_Free(h->a);
        h->a = NULL;
        h->cap = 0;
    } else if (h->cap > 64 && h->n < h->cap / 4) {
        uint32_t cap = h->cap / 2;
        Packet **a = PyMem_Realloc(h->a, cap * sizeof(Packet *));
        if (a != NULL) {
            h->a = a;
            h->cap = cap;
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Levels */

static inline int mask_has(const uint64_t *mask, int prio) {
    return (mask[prio >> 6] >> (prio & 63)) & 1;
}

/* The index of prio's level in q->levels: how many levels have a lower prio. */
static inline int level_rank(const QueueObject *q, int prio) {
    int rank = 0, word = prio >> 6;
    for (int w = 0; w < word; w++)
        rank += __builtin_popcountll(q->mask[w]);
    uint64_t below = q->mask[word] & ((1ull << (prio & 63)) - 1);
    return rank + __builtin_popcountll(below);
}

static inline Level *level_of(QueueObject *q, int prio) {
    return mask_has(q->mask, prio) ? &q->levels[level_rank(q, prio)] : NULL;
}

/* The best selectable level (prio 1..255), or NULL. */
static inline Level *best_level(QueueObject *q) {
    if (q->nlevels == 0)
        return NULL;
    Level *first = &q->levels[0];
    if (first->prio != 0)
        return first;
    return q->nlevels > 1 ? &q->levels[1] : NULL;
}

static Level *level_make(QueueObject *q, int prio) {
    if (q->nlevels == q->level_cap) {
        uint16_t cap = q->level_cap ? (q->level_cap * 2 > 256 ? 256 : q->level_cap * 2) : 2;
        Level *levels = PyMem_Realloc(q->levels, cap * sizeof(Level));
        if (levels == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        q->levels = levels;
        q->level_cap = cap;
    }
    int rank = level_rank(q, prio);
    memmove(&q->levels[rank + 1], &q->levels[rank], (q->nlevels - rank) * sizeof(Level));
    q->nlevels++;
    q->mask[prio >> 6] |= 1ull << (prio & 63);
    Level *level = &q->levels[rank];
    memset(level, 0, sizeof(Level));
    level->prio = (uint8_t)prio;
    return level;
}

static void level_drop(QueueObject *q, Level *level) {
    int prio = level->prio, rank = (int)(level - q->levels);
    PyMem_Free(level->a);
    memmove(&q->levels[rank], &q->levels[rank + 1], (q->nlevels - rank - 1) * sizeof(Level));
    q->nlevels--;
    q->mask[prio >> 6] &= ~(1ull << (prio & 63));
    if (q->nlevels == 0) {
        PyMem_Free(q->levels);
        q->levels = NULL;
        q->level_cap = 0;
    }
}

/* Room for one more entry at the end (or anywhere: the caller may shift). */
static int level_reserve(Level *level) {
    if (level->end < level->cap)
        return 0;
    uint32_t len = level->end - level->start;
    if (level->start > 0 && level->start >= len / 2) { /* reuse the room a drained front left */
        memmove(level->a, level->a + level->start, len * sizeof(Entry));
        level->start = 0;
        level->end = len;
        return 0;
    }
    uint32_t cap = level->cap ? level->cap + level->cap / 2 + 2 : 2;
    Entry *a = PyMem_Realloc(level->a, cap * sizeof(Entry));
    if (a == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    level->a = a;
    level->cap = cap;
    return 0;
}

/* Give back memory of a level that shrank to a quarter of its room. */
static void level_shrink(Level *level) {
    uint32_t len = level->end - level->start;
    if (level->cap <= 64 || len >= level->cap / 4)
        return;
    memmove(level->a, level->a + level->start, len * sizeof(Entry));
    level->start = 0;
    level->end = len;
    uint32_t cap = level->cap / 2;
    Entry *a = PyMem_Realloc(level->a, cap * sizeof(Entry));
    if (a != NULL) {
        level->a = a;
        level->cap = cap;
    }
}

/* Index of the first entry whose seq is >= seq. */
static uint32_t level_bisect(const Level *level, uint64_t seq) {
    uint32_t lo = level->start, hi = level->end;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (ENTRY_SEQ(level->a[mid]) < seq)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Drop tombstones at both ends, so the first and last entries are live; drops an emptied
 * level. */
static void level_trim(QueueObject *q, Level *level) {
    while (level->start < level->end && IS_TOMB(level->a[level->start])) {
        level->start++;
        level->stale--;
        q->entries--;
    }
    while (level->end > level->start && IS_TOMB(level->a[level->end - 1])) {
        level->end--;
        level->stale--;
        q->entries--;
    }
    if (level->start == level->end)
        level_drop(q, level);
    else
        level_shrink(level);
}

/* File p in its level. Push order: at the end if it is the newest (``newest``: its seq is
 * the store's latest, so no record need be read to know), else by bisection, reusing the
 * tombstone it left if it comes back from a lease. */
static int level_add(QueueObject *q, Packet *p, int newest) {
    Level *level = level_of(q, p->prio);
    if (level == NULL && (level = level_make(q, p->prio)) == NULL)
        return -1;
    if (!newest && level->end > level->start && ENTRY_SEQ(level->a[level->end - 1]) > p->seq) {
        uint32_t at = level_bisect(level, p->seq);
        if (at < level->end && IS_TOMB(level->a[at]) && ENTRY_SEQ(level->a[at]) == p->seq) {
            level->a[at] = (Entry)p;
            level->stale--;
            return 0;
        }
        if (level_reserve(level) < 0)
            return -1;
        at = level_bisect(level, p->seq);
        memmove(&level->a[at + 1], &level->a[at], (level->end - at) * sizeof(Entry));
        level->a[at] = (Entry)p;
        level->end++;
        q->entries++;
        return 0;
    }
    if (level_reserve(level) < 0)
        return -1;
    level->a[level->end++] = (Entry)p;
    q->entries++;
    return 0;
}

/* Take p out of its level, wherever it is: a tombstone in its place (O(log n)). */
static void level_remove(QueueObject *q, Packet *p) {
    Level *level = level_of(q, p->prio);
    if (level->a[level->end - 1] == (Entry)p) {
        level->end--;
        q->entries--;
    } else {
        uint32_t at = level_bisect(level, p->seq);
        level->a[at] = TOMB(p->seq);
        level->stale++;
    }
    level_trim(q, level);
}

/* Rebuild the levels without tombstones once they outnumber the live packets. O(entries). */
static void levels_compact(QueueObject *q) {
    for (int i = 0; i < q->nlevels; i++) {
        Level *level = &q->levels[i];
        uint32_t out = 0;
        for (uint32_t j = level->start; j < level->end; j++)
            if (!IS_TOMB(level->a[j]))
                level->a[out++] = level->a[j];
        level->start = 0;
        level->end = out;
        level->stale = 0;
        level_shrink(level);
    }
    q->entries = q->size;
}

static inline void maybe_compact(QueueObject *q) {
    if (q->entries > 2 * q->size + STALE_SLACK)
        levels_compact(q);
}

/* ---------------------------------------------------------------------------------------- */
/* Queues */

static QueueObject *queue_new(PyObject *name) {
    QueueObject *q = PyObject_New(QueueObject, &QueueType);
    if (q == NULL)
        return NULL;
    Py_INCREF(name);
    q->name = name;
    q->slots = NULL;
    q->slot_cap = q->groups = 0;
    q->slots_mapped = 0;
    memset(q->mask, 0, sizeof(q->mask));
    q->levels = NULL;
    q->nlevels = q->level_cap = 0;
    q->size = q->bytes = q->entries = 0;
    q->qheap.a = NULL;
    q->qheap.n = q->qheap.cap = 0;
    q->delayed_head = NULL;
    q->delayed = q->delayed_bytes = 0;
    q->dslots = NULL;
    q->dslot_cap = 0;
    return q;
}

/* Free every record the queue still holds (the store took them out of its heap already). */
static void queue_free_packets(QueueObject *q) {
    for (uint32_t i = 0; i < q->slot_cap; i++) {
        Packet *head = SLOT_PACKET(q->slots[i]);
        if (head == NULL)
            continue;
        Packet *p = head;
        do {
            Packet *next = p->gnext;
            PyMem_Free(p);
            p = next;
        } while (p != head);
        q->slots[i] = 0;
    }
    q->groups = 0;
    if (q->delayed_head != NULL) {
        Packet *p = q->delayed_head;
        do {
            Packet *next = p->gnext;
            PyMem_Free(p);
            p = next;
        } while (p != q->delayed_head);
        q->delayed_head = NULL;
    }
}

static void queue_dealloc(QueueObject *q) {
    queue_free_packets(q);
    table_free(q->slots, (size_t)q->slot_cap * sizeof(Slot), q->slots_mapped);
    PyMem_Free(q->dslots);
    for (int i = 0; i < q->nlevels; i++)
        PyMem_Free(q->levels[i].a);
    PyMem_Free(q->levels);
    PyMem_Free(q->qheap.a);
    Py_DECREF(q->name);
    PyObject_Free(q);
}

static PyTypeObject QueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pinpriq._packed._Queue",
    .tp_basicsize = sizeof(QueueObject),
    .tp_dealloc = (destructor)queue_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
};

static inline QueueObject *store_queue(StoreObject *s, PyObject *name) {
    if (name == s->last_name && s->last_queue != NULL)
        return s->last_queue;
    QueueObject *q = (QueueObject *)PyDict_GetItemWithError(s->queues, name);
    if (q != NULL) {
        Py_INCREF(name);
        Py_XSETREF(s->last_name, name);
        s->last_queue = q;
    }
    return q;
}

/* Take q out of the store's dict (which frees it unless the caller holds it). */
static int store_drop_queue(StoreObject *s, QueueObject *q) {
    if (s->last_queue == q)
        s->last_queue = NULL;
    return PyDict_DelItem(s->queues, q->name);
}

/* The queue named ``name``, made if missing. New queues are filed under the store's own copy
 * of the name (a bytes object that stays). */
static QueueObject *store_queue_make(StoreObject *s, PyObject *name) {
    QueueObject *q = store_queue(s, name);
    if (q != NULL || PyErr_Occurred())
        return q;
    q = queue_new(name);
    if (q == NULL)
        return NULL;
    if (PyDict_SetItem(s->queues, name, (PyObject *)q) < 0) {
        Py_DECREF(q);
        return NULL;
    }
    Py_DECREF(q); /* the dict holds it */
    return q;
}

/* Forget a queue that holds nothing (decision 5). */
static int store_forget_if_empty(StoreObject *s, QueueObject *q) {
    if (q->size == 0 && q->delayed == 0)
        return store_drop_queue(s, q);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Filing and unfiling packets */

/* The seconds a clock (a callable returning a float) reads; NAN with an exception set on
 * error. */
static double clock_seconds(PyObject *clock) {
    PyObject *value = PyObject_CallNoArgs(clock);
    if (value == NULL)
        return NAN;
    double seconds = PyFloat_AsDouble(value);
    Py_DECREF(value);
    return seconds == -1.0 && PyErr_Occurred() ? NAN : seconds;
}

/* The store's clock (monotonic seconds). */
static inline double store_now(StoreObject *s) { return clock_seconds(s->clock); }

/* The wall clock's seconds since the epoch (``attach_log``'s wall_clock). */
static inline double store_wall(StoreObject *s) { return clock_seconds(s->wall_clock); }

/* Spare records: a popped record's memory, kept for the next push of the same size class.
 * At depth, the record a pop frees lies in a cold pymalloc pool, and pymalloc's free reads
 * and relinks that pool's header (a cache miss more per pop, besides the record's own); kept
 * here, the block is reused by the push that follows while still in cache, and neither the
 * free nor the malloc touches a pool. Records of up to SPARE_MAX bytes, in 16-byte classes
 * (pymalloc's own rounding, so a spare fits any record of its class), at most SPARE_PER_CLASS
 * a class: under 70 KiB in all. Any record may still go to PyMem_Free; pop_write, where
 * records leave in a mix's hot path, gives them to packet_free. Module state, as CPython's
 * own free lists: the GIL serialises every call. */
#define SPARE_MAX 256
#define SPARE_PER_CLASS 16
#define SPARE_CLASS(bytes) (((bytes) + 15) >> 4)
#define SPARE_CLASSES (SPARE_CLASS(SPARE_MAX) + 1)
static Packet *spare[SPARE_CLASSES]; /* linked through gnext */
static uint32_t spare_count[SPARE_CLASSES];

static inline size_t record_bytes(Py_ssize_t klen, Py_ssize_t plen) {
    size_t bytes = offsetof(Packet, data) + (size_t)klen + (size_t)plen;
    return bytes <= SPARE_MAX ? (bytes + 15) & ~(size_t)15 : bytes;
}

static inline Packet *record_alloc(size_t bytes) {
    if (bytes <= SPARE_MAX) {
        Packet *p = spare[SPARE_CLASS(bytes)];
        if (p != NULL) {
            spare[SPARE_CLASS(bytes)] = p->gnext;
            spare_count[SPARE_CLASS(bytes)]--;
            return p;
        }
    }
    return PyMem_Malloc(bytes);
}

/* Free a record that left the store (its links and indexes no longer matter). */
static inline void packet_free(Packet *p) {
    size_t bytes = record_bytes(p->klen, p->plen);
    if (bytes <= SPARE_MAX && spare_count[SPARE_CLASS(bytes)] < SPARE_PER_CLASS) {
        p->gnext = spare[SPARE_CLASS(bytes)];
        spare[SPARE_CLASS(bytes)] = p;
        spare_count[SPARE_CLASS(bytes)]++;
        return;
    }
    PyMem_Free(p);
}

static Packet *packet_new(const char *key, Py_ssize_t klen, const char *payload,
                          Py_ssize_t plen) {
    if (klen > MAX_FIELD || plen > MAX_FIELD) {
        PyErr_SetString(PyExc_ValueError, "a key or payload longer than 65535 bytes");
        return NULL;
    }
    Packet *p = record_alloc(record_bytes(klen, plen));
    if (p == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (!ADDRESS_FITS(p)) { /* not on x86-64 Linux's allocators: the slot could not hold it */
        PyMem_Free(p);
        PyErr_SetString(PyExc_MemoryError, "packed store: a record's address has no room");
        return NULL;
    }
    p->klen = (uint16_t)klen;
    p->plen = (uint16_t)plen;
    memcpy(p->data, key, klen);
    memcpy(p->data + klen, payload, plen);
    p->hpos = p->qhpos = 0;
    p->ttl_ms = p->leases = 0;
    p->flags = 0;
    p->gnext = p->gprev = p;
    return p;
}

/* File a packet (seq, prio, deadline set) in queue q: its group, its level, the heaps;
 * ``newest``: its seq is the latest the store gave. Counts it in q->size and q->bytes (not in
 * the store's totals: the caller's). */
static int file_packet(StoreObject *s, QueueObject *q, Packet *p, int newest) {
    if (groups_reserve(q) < 0)
        return -1;
    if (level_add(q, p, newest) < 0)
        return -1;
    group_add(q, p);
    p->queue = q;
    if (p->deadline != INFINITY) {
        if (heap_push(&s->heap, p, 0) < 0 || heap_push(&q->qheap, p, 1) < 0) {
            PyErr_Clear(); /* out of memory for the heap: keep the packet without a TTL */
            if (p->hpos)
                heap_remove(&s->heap, p, 0);
            p->deadline = INFINITY;
        }
    }
    q->size++;
    q->bytes += HELD(p);
    return 0;
}

/* Take a live packet out of everything in q but its key group: its level, the heaps. */
static void unfile_ungrouped(StoreObject *s, QueueObject *q, Packet *p) {
    level_remove(q, p);
    if (p->hpos)
        heap_remove(&s->heap, p, 0);
    if (p->qhpos)
        heap_remove(&q->qheap, p, 1);
    q->size--;
    q->bytes -= HELD(p);
}

/* Take a live packet out of everything in q (group, level, heaps); the caller frees it or
 * turns it into a tuple, and fixes the counts. */
static void unfile_packet(StoreObject *s, QueueObject *q, Packet *p) {
    group_remove(q, p);
    unfile_ungrouped(s, q, p);
}

/* A packet as the contract's tuple: (key, payload, prio, seq, deadline, leases). */
static PyObject *packet_tuple(const Packet *p) {
    PyObject *t = PyTuple_New(6);
    if (t == NULL)
        return NULL;
    PyObject *key = PyBytes_FromStringAndSize(KEY(p), p->klen);
    PyObject *payload = PyBytes_FromStringAndSize(PAYLOAD(p), p->plen);
    PyObject *seq = PyLong_FromUnsignedLongLong(p->seq);
    PyObject *deadline;
    if (p->deadline == INFINITY) {
        Py_INCREF(inf_float);
        deadline = inf_float;
    } else {
        deadline = PyFloat_FromDouble(p->deadline);
    }
    PyObject *leases = PyLong_FromUnsignedLong(p->leases);
    PyTuple_SET_ITEM(t, 0, key);
    PyTuple_SET_ITEM(t, 1, payload);
    PyTuple_SET_ITEM(t, 2, PyLong_FromLong(p->prio));
    PyTuple_SET_ITEM(t, 3, seq);
    PyTuple_SET_ITEM(t, 4, deadline);
    PyTuple_SET_ITEM(t, 5, leases);
    if (!key || !payload || !seq || !deadline || !leases || !PyTuple_GET_ITEM(t, 2)) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}


/* ---------------------------------------------------------------------------------------- */
/* Log hooks (persistence): the entries of persistence/records.py, byte for byte
 *
 * With a log attached (attach_log: the journal's open block, see persistence/packed_store.py)
 * every push appends its entry (70, or 71 for a u32 TTL or a delay; 6d for a move's) to
 * log_pushes, and every packet that leaves for good (pop, pop_reply, expiry, purge, a move's
 * old seq) a remove entry (72) to log_removals, here in C where the packet is: nothing is
 * copied but into the block, and no Python object is made per packet (the journal reads the
 * removed seqs back from the entries when it needs them). A take logs nothing (decision 19).
 * frame_block frames the block at the end of a batch. */

#define LOG_PUSH 0x70
#define LOG_OPTIONS 0x71
#define LOG_MOVED 0x6D
#define LOG_REMOVE 0x72
#define LOG_MAX_PUSH_TTL 0xFFFF

/* v with its bytes in big-endian order. */
static inline uint64_t big_endian64(uint64_t v) {
#if PY_BIG_ENDIAN
    return v;
#elif defined(__GNUC__) || defined(__clang__)
    return __builtin_bswap64(v);
#else
    uint64_t swapped = 0;
    for (int i = 0; i < 8; i++, v >>= 8)
        swapped = swapped << 8 | (v & 0xFF);
    return swapped;
#endif
}

/* The low `bytes` bytes of v at b, big-endian; where the next field goes. `bytes` (1 to 8) is
 * a constant at every call, so this is a shift, a byte swap and one store: a loop of byte
 * stores was ~50 of the ~90 instructions of a remove entry. */
static inline unsigned char *put_be(unsigned char *b, uint64_t v, int bytes) {
    uint64_t word = big_endian64(v << (8 * (8 - bytes)));
    memcpy(b, &word, (size_t)bytes);
    return b + bytes;
}

/* The open block's bytearrays keep their allocation from block to block (below), up to this
 * many bytes: a larger block's room is given back when it is framed, so one huge batch does
 * not pin its size for the server's life. */
#define LOG_KEPT_ROOM (1 << 20)

/* Room for size more bytes at the end of bytearray ba; where they go, or NULL.
 *
 * Written on the bytearray's own fields (cpython/bytearrayobject.h) where it has the room, as
 * bytearray_resize's own quick path does: PyByteArray_Resize shrinks a bytearray to its exact
 * size whenever the new size is below half its allocation (as the size 0 of each new block
 * is) and grows it by an eighth at a time, so a block of a few kilobytes used to be
 * reallocated dozens of times, copied each time (~150 instructions an entry at -P 64). Growth
 * here doubles the allocation, which the next blocks reuse (frame_block keeps it). */
static inline unsigned char *log_room(PyObject *ba, Py_ssize_t size) {
    PyByteArrayObject *array = (PyByteArrayObject *)ba;
    Py_ssize_t at = Py_SIZE(array), end = at + size;
    if (end < array->ob_alloc && array->ob_start == array->ob_bytes && !array->ob_exports) {
        Py_SET_SIZE(array, end);
        array->ob_start[end] = '\0';
        return (unsigned char *)array->ob_start + at;
    }
    /* Twice the size needed: more than an eighth above the old allocation, so Resize makes
     * it exactly that, and the second call, to at least half of it, only sets the size. */
    if (PyByteArray_Resize(ba, 2 * end) < 0 || PyByteArray_Resize(ba, end) < 0)
        return NULL;
    return (unsigned char *)PyByteArray_AS_STRING(ba) + at;
}

/* Empty bytearray ba for the next block, keeping its allocation up to LOG_KEPT_ROOM. */
static inline int log_clear(PyObject *ba) {
    PyByteArrayObject *array = (PyByteArrayObject *)ba;
    if (array->ob_alloc > LOG_KEPT_ROOM || array->ob_start != array->ob_bytes || array->ob_exports)
        return PyByteArray_Resize(ba, 0);
    Py_SET_SIZE(array, 0);
    if (array->ob_start != NULL)
        array->ob_start[0] = '\0';
    return 0;
}

/* A queue name the log can hold (a u16 length), checked before anything changes. */
static inline int log_queue_fits(StoreObject *s, PyObject *queue) {
    if (s->log_pushes != NULL && PyBytes_Check(queue) && PyBytes_GET_SIZE(queue) > MAX_FIELD) {
        PyErr_SetString(PyExc_ValueError, "a queue name longer than 65535 bytes");
        return -1;
    }
    return 0;
}

/* Note the wall clock at the open block's first push: its base_ms. The wall clock, not the
 * store's: under trio the store's clock is interpreted (trio.current_time), a call several
 * times the cost of time.time, and converting it at the block's seal took a second call. */
static inline int log_block_start(StoreObject *s) {
    if (PyByteArray_GET_SIZE(s->log_pushes))
        return 0;
    double wall = store_wall(s);
    if (wall != wall)
        return -1;
    s->block_wall = wall;
    return 0;
}

/* Append p's push-kind entry: kind LOG_PUSH (field: the TTL), LOG_OPTIONS (field: the TTL,
 * delay: the delay) or LOG_MOVED (field: the wall-clock deadline in ms, 0: none). */
static int log_push(StoreObject *s, int kind, PyObject *queue, const Packet *p, uint64_t field,
                    uint32_t delay) {
    if (log_block_start(s) < 0)
        return -1;
    Py_ssize_t qlen = PyBytes_GET_SIZE(queue);
    Py_ssize_t header = kind == LOG_PUSH ? 10 : 16;
    unsigned char *b = log_room(s->log_pushes, header + qlen + p->klen + p->plen);
    if (b == NULL)
        return -1;
    *b++ = (unsigned char)kind;
    if (kind == LOG_PUSH) {
        b = put_be(b, field, 2);
    } else if (kind == LOG_OPTIONS) {
        b = put_be(b, field, 4);
        b = put_be(b, delay, 4);
    } else {
        b = put_be(b, field, 8);
    }
    *b++ = p->prio;
    b = put_be(b, (uint64_t)qlen, 2);
    b = put_be(b, p->klen, 2);
    b = put_be(b, p->plen, 2);
    memcpy(b, PyBytes_AS_STRING(queue), qlen);
    memcpy(b + qlen, p->data, p->klen + p->plen);
    return 0;
}

/* Append a remove entry for seq. */
static int log_remove(StoreObject *s, uint64_t seq) {
    unsigned char *b = log_room(s->log_removals, 9);
    if (b == NULL)
        return -1;
    *b = LOG_REMOVE;
    put_be(b + 1, seq, 8);
    return 0;
}

/* Log p's removal, if the store logs (a pop's packet, gone for good). */
static inline int log_popped(StoreObject *s, const Packet *p) {
    return s->log_pushes == NULL ? 0 : log_remove(s, p->seq);
}

static int log_removals(StoreObject *s, Packet **packets, Py_ssize_t n) {
    if (s->log_pushes == NULL)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (log_remove(s, packets[i]->seq) < 0)
            return -1;
    return 0;
}

/* attach_log(pushes, removals, wall_clock): log into the journal's open block from now on
 * (persistence/packed_store.py); the bytearrays are kept by reference. */
static PyObject *Store_attach_log(StoreObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyByteArray_Check(args[0]) || !PyByteArray_Check(args[1]) ||
        !PyCallable_Check(args[2]) || !PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "attach_log(pushes: bytearray, removals: bytearray, wall_clock, "
                        "taken: dict)");
        return NULL;
    }
    Py_XSETREF(s->log_pushes, Py_NewRef(args[0]));
    Py_XSETREF(s->log_removals, Py_NewRef(args[1]));
    Py_XSETREF(s->wall_clock, Py_NewRef(args[2]));
    Py_XSETREF(s->taken, Py_NewRef(args[3]));
    Py_RETURN_NONE;
}

static PyObject *Store_get_block_wall(StoreObject *s, void *unused) {
    return PyFloat_FromDouble(s->block_wall);
}

/* ---------------------------------------------------------------------------------------- */
/* Framing the open block (persistence/journal.py's Journal.seal_framed)
 *
 * A block without copies (every block but compaction's and a dead-letter move's) is framed
 * here, into the bytes the journal writes, with no other object made:
 * persistence/records.py's encode_block (magic, body length, CRC-32 of the length's 4 bytes
 * and the body; the body seq_base, base_ms, the push-kind entries, the remove entries), byte
 * for byte. Writing it (and every error of writing) stays the journal's. */

#define BLOCK_HEADER_SIZE 12
#define BODY_HEADER_SIZE 16

/* CRC-32 as zlib.crc32 computes it (reflected polynomial 0xEDB88320): by carry-less
 * multiplication on an x86-64 CPU that has it (crc32_fold), else by tables, eight bytes a
 * step. */
static uint32_t crc_table[8][256];

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CRC_FOLD 1
#include <immintrin.h>

/* Whether this CPU has carry-less multiplication (PCLMULQDQ) and SSE4.1: set by crc_init. */
static int crc_fold_usable;
#endif

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++)
            crc_table[t][i] = crc_table[0][crc_table[t - 1][i] & 0xFF] ^ (crc_table[t - 1][i] >> 8);
#ifdef CRC_FOLD
    __builtin_cpu_init();
    crc_fold_usable = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
}

/* zlib.crc32(data, crc), a table lookup a byte (eight a step): short inputs and the tails
 * crc32_fold leaves. */
static uint32_t crc32_table(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
#if PY_LITTLE_ENDIAN
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t low, high;
        memcpy(&low, p, 4);
        memcpy(&high, p + 4, 4);
        low ^= crc;
        crc = crc_table[7][low & 0xFF] ^ crc_table[6][(low >> 8) & 0xFF] ^
              crc_table[5][(low >> 16) & 0xFF] ^ crc_table[4][low >> 24] ^
              crc_table[3][high & 0xFF] ^ crc_table[2][(high >> 8) & 0xFF] ^
              crc_table[1][(high >> 16) & 0xFF] ^ crc_table[0][high >> 24];
    }
#endif
    while (n--)
        crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

#ifdef CRC_FOLD
/* The CRC-32 of zlib (reflected polynomial 0xEDB88320) by folding 64 bytes a step with
 * carry-less multiplication, then a Barrett reduction: Intel's "Fast CRC Computation for
 * Generic Polynomials Using PCLMULQDQ Instruction" (2009), with the constants of its
 * bit-reflected form, as Chromium's zlib (crc32_simd.c) and Linux (crc32-pclmul) use them.
 * crc is the running CRC already inverted (~zlib's); n is at least 64 and a multiple of 16.
 * About 0.3 instructions a byte against the table's 4: at -P 64 the CRC of each block was
 * ~200 instructions a pushed and popped packet, a quarter of what the log cost. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc32_fold(uint32_t crc,
                                                                      const unsigned char *p,
                                                                      size_t n) {
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
    const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124);
    const __m128i poly = _mm_set_epi64x(0x01f7011641, 0x01db710641);
    const __m128i low32 = _mm_setr_epi32(~0, 0, ~0, 0);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(p + 0x00));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 0x10));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 0x20));
    __m128i x4 = _mm_loadu_si128((const __m128i *)(p + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    p += 64;
    n -= 64;
    for (; n >= 64; p += 64, n -= 64) { /* four lanes of 16 bytes, each folded 64 ahead */
        __m128i y1 = _mm_clmulepi64_si128(x1, k1k2, 0x00);
        __m128i y2 = _mm_clmulepi64_si128(x2, k1k2, 0x00);
        __m128i y3 = _mm_clmulepi64_si128(x3, k1k2, 0x00);
        __m128i y4 = _mm_clmulepi64_si128(x4, k1k2, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k1k2, 0x11);
        x2 = _mm_clmulepi64_si128(x2, k1k2, 0x11);
        x3 = _mm_clmulepi64_si128(x3, k1k2, 0x11);
        x4 = _mm_clmulepi64_si128(x4, k1k2, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, y1), _mm_loadu_si128((const __m128i *)(p + 0x00)));
        x2 = _mm_xor_si128(_mm_xor_si128(x2, y2), _mm_loadu_si128((const __m128i *)(p + 0x10)));
        x3 = _mm_xor_si128(_mm_xor_si128(x3, y3), _mm_loadu_si128((const __m128i *)(p + 0x20)));
        x4 = _mm_xor_si128(_mm_xor_si128(x4, y4), _mm_loadu_si128((const __m128i *)(p + 0x30)));
    }
    /* the four lanes into one, then 16 bytes a step */
    __m128i lanes[3] = {x2, x3, x4};
    for (int i = 0; i < 3; i++) {
        __m128i y = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11), lanes[i]), y);
    }
    for (; n >= 16; p += 16, n -= 16) {
        __m128i y = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, _mm_loadu_si128((const __m128i *)p)), y);
    }
    /* 128 bits to 64, then the Barrett reduction to 32 */
    __m128i y = _mm_clmulepi64_si128(x1, k3k4, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), y);
    y = _mm_srli_si128(x1, 4);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, low32), k5k0, 0x00), y);
    y = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), poly, 0x10);
    y = _mm_clmulepi64_si128(_mm_and_si128(y, low32), poly, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x1, y), 1);
}
#endif

/* zlib.crc32(data, crc) */
static uint32_t crc32_of(uint32_t crc, const unsigned char *p, size_t n) {
#ifdef CRC_FOLD
    if (crc_fold_usable && n >= 64) {
        size_t folded = n & ~(size_t)15;
        crc = ~crc32_fold(~crc, p, folded);
        p += folded;
        n -= folded;
    }
#endif
    return crc32_table(crc, p, n);
}

/* The open block's base_ms, as persistence/store.py's block_base_ms computes it (the same
 * floating-point operation, so the same integer): its first push on the wall clock, rounded
 * down; 0 without pushes. */
static int64_t log_base_ms(StoreObject *s) {
    if (!PyByteArray_GET_SIZE(s->log_pushes))
        return 0;
    return (int64_t)(s->block_wall * 1000);
}

/* The open block's body size (its entries and body header), checked to fit a block; 0 if it
 * is empty; -1 with an exception set if it is too large or its base_ms is before 1970. */
static Py_ssize_t open_block_body(StoreObject *s) {
    if (s->log_pushes == NULL) {
        PyErr_SetString(PyExc_TypeError, "framing a block: no log attached");
        return -1;
    }
    Py_ssize_t entries = PyByteArray_GET_SIZE(s->log_pushes) + PyByteArray_GET_SIZE(s->log_removals);
    if (!entries)
        return 0;
    Py_ssize_t body = BODY_HEADER_SIZE + entries;
    if ((uint64_t)body > 0xFFFFFFFFu) {
        PyErr_SetString(PyExc_OverflowError, "a block of more than 4 GiB");
        return -1;
    }
    if (log_base_ms(s) < 0) {
        PyErr_SetString(PyExc_ValueError, "a block's wall-clock time before 1970");
        return -1;
    }
    return body;
}

/* Frame the open block (body: open_block_body's) at start, which has room for
 * BLOCK_HEADER_SIZE + body bytes, and clear it. */
static int frame_open_block(StoreObject *s, uint64_t seq_base, unsigned char *start,
                            Py_ssize_t body) {
    Py_ssize_t pushed = PyByteArray_GET_SIZE(s->log_pushes);
    Py_ssize_t removed = PyByteArray_GET_SIZE(s->log_removals);
    memcpy(start, "PQLB", 4);
    put_be(start + 4, (uint64_t)body, 4);
    unsigned char *b = start + BLOCK_HEADER_SIZE;
    b = put_be(b, seq_base, 8);
    b = put_be(b, (uint64_t)log_base_ms(s), 8);
    memcpy(b, PyByteArray_AS_STRING(s->log_pushes), pushed);
    memcpy(b + pushed, PyByteArray_AS_STRING(s->log_removals), removed);
    uint32_t crc = crc32_of(crc32_of(0, start + 4, 4), start + BLOCK_HEADER_SIZE, body);
    put_be(start + 8, crc, 4);
    return log_clear(s->log_pushes) < 0 || log_clear(s->log_removals) < 0 ? -1 : 0;
}

/* frame_block(seq_base) -> bytes | None: the open block (seq_base: the store's seq before
 * its first push) framed as a whole block, and the open block's entries cleared; None for an
 * empty block. */
static PyObject *Store_frame_block(StoreObject *s, PyObject *arg) {
    unsigned long long seq_base = PyLong_AsUnsignedLongLong(arg);
    if (seq_base == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t body = open_block_body(s);
    if (body <= 0)
        return body < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *block = PyBytes_FromStringAndSize(NULL, BLOCK_HEADER_SIZE + body);
    if (block == NULL)
        return NULL;
    if (frame_open_block(s, seq_base, (unsigned char *)PyBytes_AS_STRING(block), body) < 0) {
        Py_DECREF(block);
        return NULL;
    }
    return block;
}

/* frame_into(seq_base, buffer, at) -> int: frame_block's block framed straight into the
 * writable buffer (the journal's mapping of its active segment) at offset at, with no bytes
 * object made and no copy of it: the bytes framed; 0 for an empty block; -1 if the block
 * would end past the buffer's end, in which case nothing is framed or cleared. */
static PyObject *Store_frame_into(StoreObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "frame_into(seq_base, buffer, at)");
        return NULL;
    }
    unsigned long long seq_base = PyLong_AsUnsignedLongLong(args[0]);
    if (seq_base == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t at = PyLong_AsSsize_t(args[2]);
    if (at == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t body = open_block_body(s);
    if (body <= 0)
        return body < 0 ? NULL : PyLong_FromLong(0);
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    Py_ssize_t size = BLOCK_HEADER_SIZE + body;
    int result = at < 0 || at > view.len || size > view.len - at
                     ? 1
                     : frame_open_block(s, seq_base, (unsigned char *)view.buf + at, body);
    PyBuffer_Release(&view);  /* at once: a mapping with a buffer exported cannot be closed */
    if (result < 0)
        return NULL;
    return PyLong_FromSsize_t(result ? -1 : size);
}

/* ---------------------------------------------------------------------------------------- */
/* Expiry and arrival */

/* A delayed packet whose time came enters its queue (decision 21), in push order by its seq,
 * with its TTL deadline (due time plus TTL); or, if that has passed too, it is dropped (TTL
 * wins). Returns 1 if dropped (the caller counts it as expired and frees it), 0 if filed, -1
 * on error. */
static int arrive(StoreObject *s, Packet *p, double now) {
    QueueObject *q = p->queue;
    if (q->delayed_head == p)
        q->delayed_head = p->gnext == p ? NULL : p->gnext;
    ring_unlink(p);
    delayed_unindex(q, p);
    q->delayed--;
    q->delayed_bytes -= HELD(p);
    s->delayed_bytes -= HELD(p);
    q->bytes -= HELD(p); /* file_packet counts it again */
    p->flags &= ~F_DELAYED;
    p->deadline = p->ttl_ms ? p->deadline + p->ttl_ms / 1000.0 : INFINITY;
    p->ttl_ms = 0;
    if (p->deadline <= now)
        return 1;
    if (file_packet(s, q, p, 0) < 0)
        return -1;
    if (!p->prio)
        s->unselectable_bytes += HELD(p);
    /* the queues arrivals entered, in order; a queue once per run of arrivals into it */
    Py_ssize_t n = PyList_GET_SIZE(s->arrived);
    int again = n ? PyObject_RichCompareBool(PyList_GET_ITEM(s->arrived, n - 1), q->name, Py_EQ)
                  : 0;
    if (again != 0)
        return again < 0 ? -1 : 0;
    return PyList_Append(s->arrived, q->name);
}

/* Remove every packet whose deadline has come, and move every due delayed packet into its
 * queue. Returns how many expired, or -1 on error. */
static Py_ssize_t store_expire(StoreObject *s) {
    if (s->heap.n == 0)
        return 0;
    double now = store_now(s);
    if (now != now)
        return -1;
    Py_ssize_t removed = 0;
    /* The log's remove entries: the expired packets', then those of delayed packets dropped
     * as they arrived (store.py's order; the same log, byte for byte). */
    uint64_t *late = NULL;
    Py_ssize_t nlate = 0, late_cap = 0;
    int failed = 0;
    while (s->heap.n && s->heap.a[0]->deadline <= now) {
        Packet *p = s->heap.a[0];
        QueueObject *q = p->queue;
        heap_remove(&s->heap, p, 0);
        if (p->flags & F_DELAYED) {
            int dropped = arrive(s, p, now);
            if (dropped < 0) {
                failed = 1;
                break;
            }
            if (!dropped)
                continue;
            if (s->log_pushes != NULL) {
                if (nlate == late_cap) {
                    late_cap = late_cap ? 2 * late_cap : 16;
                    uint64_t *grown = PyMem_Realloc(late, late_cap * sizeof(uint64_t));
                    if (grown == NULL) {
                        PyErr_NoMemory();
                        failed = 1;
                    } else {
                        late = grown;
                    }
                }
                if (!failed)
                    late[nlate++] = p->seq;
            }
        } else {
            unfile_packet(s, q, p);
            if (!p->prio)
                s->unselectable_bytes -= HELD(p);
            if (s->log_pushes != NULL && log_remove(s, p->seq) < 0)
                failed = 1;
        }
        s->bytes_held -= HELD(p);
        s->held--;
        removed++;
        PyMem_Free(p);
        if (q->size == 0 && q->delayed == 0) {
            if (store_forget_if_empty(s, q) < 0)
                failed = 1;
        } else {
            maybe_compact(q);
        }
        if (failed)
            break;
    }
    for (Py_ssize_t i = 0; !failed && i < nlate; i++)
        failed = log_remove(s, late[i]) < 0;
    PyMem_Free(late);
    s->expired += removed;
    return failed ? -1 : removed;
}

/* Expire first if anything is due: every read does, so nothing expired is ever returned. */
static inline int expire_due(StoreObject *s) {
    if (s->heap.n == 0)
        return 0;
    double now = store_now(s);
    if (now != now)
        return -1;
    if (s->heap.a[0]->deadline <= now)
        return store_expire(s) < 0 ? -1 : 0;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Pop */

/* Pops tend to come in runs on one level: ask the memory for what the next two will read,
 * so that at depth 1M they find it in cache (a record and a group slot are each a miss).
 * The next pop's record was asked for by this one, so its key can be hashed now and its slot
 * asked for; the record after it is asked for too. */
static inline void prefetch_next_pops(QueueObject *q, Level *level) {
    uint32_t len = level->end - level->start;
    if (len > 2 && !IS_TOMB(level->a[level->end - 3]))
        __builtin_prefetch((void *)level->a[level->end - 3]);
    if (len > 1 && !IS_TOMB(level->a[level->end - 2])) {
        Packet *next = (Packet *)level->a[level->end - 2];
        uint64_t hash = hash_key(KEY(next), next->klen);
        __builtin_prefetch(&q->slots[hash_home(hash, q->slot_cap)]);
    }
}

/* Remove the best packet and up to most - 1 siblings into out (which has room for most);
 * returns how many, 0 if nothing is selectable. Records are detached, not freed. */
static Py_ssize_t take_group(StoreObject *s, QueueObject *q, Packet **out, Py_ssize_t most) {
    Level *level = best_level(q);
    if (level == NULL)
        return 0;
    Packet *selected = (Packet *)level->a[level->end - 1];
    prefetch_next_pops(q, level);
    Py_ssize_t count = 1;
    out[0] = selected;
    if (selected->gnext != selected) { /* siblings: oldest first */
        Packet *head = group_head(q, selected);
        for (Packet *p = head; count < most; p = p->gnext) {
            if (p != selected)
                out[count++] = p;
            if (p->gnext == head)
                break;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++)
        unfile_packet(s, q, out[i]);
    int64_t held = 0, riders = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        held += HELD(out[i]);
        if (!out[i]->prio)
            riders += HELD(out[i]);
    }
    s->bytes_held -= held;
    s->unselectable_bytes -= riders;
    s->held -= count;
    return count;
}

/* Room for a pop's packets: ``one`` for a lone key (the common case), else its group's size
 * (at most max_pop). */
static Packet **reply_room(StoreObject *s, QueueObject *q, Packet **one) {
    Level *level = best_level(q);
    if (level == NULL || s->max_pop == 1)
        return one;
    Packet *selected = (Packet *)level->a[level->end - 1];
    if (selected->gnext == selected)
        return one;
    Py_ssize_t room = 1;
    for (Packet *p = selected->gnext; p != selected && room < s->max_pop; p = p->gnext)
        room++;
    Packet **out = PyMem_Malloc(room * sizeof(Packet *));
    if (out == NULL)
        PyErr_NoMemory();
    return out;
}

/* After a pop from q: forget it if empty, else compact if needed. */
static int after_pop(StoreObject *s, QueueObject *q) {
    if (q->size == 0 && q->delayed == 0)
        return store_forget_if_empty(s, q);
    maybe_compact(q);
    return 0;
}

/* pop or take: the packets as tuples. */
static PyObject *pop_tuples(StoreObject *s, PyObject *name, int taking) {
    if (expire_due(s) < 0)
        return NULL;
    QueueObject *q = store_queue(s, name);
    if (q == NULL)
        return PyErr_Occurred() ? NULL : PyList_New(0);
    Packet *one[1];
    Packet **out = reply_room(s, q, one);
    if (out == NULL)
        return NULL;
    Py_INCREF(q);
    Py_ssize_t count = take_group(s, q, out, s->max_pop);
    PyObject *reply = PyList_New(count);
    if (!taking && reply != NULL && log_removals(s, out, count) < 0)
        Py_CLEAR(reply);
    int64_t held = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Packet *p = out[i];
        held += HELD(p);
        if (reply != NULL) {
            PyObject *t = packet_tuple(p);
            if (t == NULL)
                Py_CLEAR(reply);
            else
                PyList_SET_ITEM(reply, i, t);
        }
        PyMem_Free(p);
    }
    if (out != one)
        PyMem_Free(out);
    if (taking) {
        s->bytes_held += held;
        s->taken_bytes += held;
    }
    if (count && after_pop(s, q) < 0)
        Py_CLEAR(reply);
    Py_DECREF(q);
    return reply;
}

static PyObject *Store_pop(StoreObject *s, PyObject *name) {
    return pop_tuples(s, name, 0);
}

static PyObject *Store_take(StoreObject *s, PyObject *name) {
    return pop_tuples(s, name, 1);
}

/* Room for n more bytes at the end of the bytearray output: where to write them, or NULL
 * (out of memory). */
static inline unsigned char *output_room(PyObject *output, Py_ssize_t n) {
    Py_ssize_t at = PyByteArray_GET_SIZE(output);
    if (PyByteArray_Resize(output, at + n) < 0)
        return NULL;
    return (unsigned char *)PyByteArray_AS_STRING(output) + at;
}

/* Write p as a reply's packet at b (u16 key length, u16 payload length, key, payload). */
static inline void write_record(unsigned char *b, const Packet *p) {
    b[0] = p->klen >> 8;
    b[1] = p->klen & 0xFF;
    b[2] = p->plen >> 8;
    b[3] = p->plen & 0xFF;
    memcpy(b + 4, p->data, p->klen + p->plen);
}

/* Take a popped p out of q's level and heaps and the store's totals; the caller takes it out
 * of its key group and frees it. */
static inline void take_popped(StoreObject *s, QueueObject *q, Packet *p) {
    unfile_ungrouped(s, q, p);
    s->bytes_held -= HELD(p);
    if (!p->prio)
        s->unselectable_bytes -= HELD(p);
    s->held--;
}

/* Pop q's best packet and up to max_pop - 1 of its key group (oldest first) into output as a
 * reply (wire.append_reply's bytes: u16 count, then the packets), in one pass: each record
 * is written, unfiled and freed in turn, and the group's slot is looked up once and set once
 * (emptied, or given the oldest packet left). Nothing selectable: the reply ``00 00`` if
 * ``empty_reply``, else nothing at all (a delivery). Returns how many packets, -1 on error
 * (out of memory before the first packet: nothing taken; after it, the rest of the group
 * stays queued and the reply says how many it holds). The output grows once for a lone key,
 * once more per sibling (bytearray over-allocates, so that is amortised). */
static Py_ssize_t pop_write(StoreObject *s, QueueObject *q, PyObject *output, int empty_reply) {
    Level *level = q != NULL ? best_level(q) : NULL;
    if (level == NULL && !empty_reply)
        return 0;
    Py_ssize_t at = PyByteArray_GET_SIZE(output), count = 0;
    Packet *selected = level != NULL ? (Packet *)level->a[level->end - 1] : NULL;
    /* room for the count and the selected packet: the whole reply, for a lone key */
    unsigned char *b = output_room(output, selected ? 6 + selected->klen + selected->plen : 2);
    if (b == NULL)
        return -1;
    if (selected != NULL) {
        prefetch_next_pops(q, level);
        uint64_t hash = hash_key(KEY(selected), selected->klen);
        /* a lone key (the common case) is its group's oldest: found by identity, reading no
         * record of another key whose hash has the same home */
        uint32_t slot = selected->gnext == selected
                            ? head_slot_hashed(q, selected, hash)
                            : group_slot_hashed(q, KEY(selected), selected->klen, hash);
        Packet *oldest = SLOT_PACKET(q->slots[slot]);
        if (log_popped(s, selected) < 0) {
            PyByteArray_Resize(output, at); /* nothing taken, nothing written */
            return -1;
        }
        write_record(b + 2, selected);
        take_popped(s, q, selected);
        count = 1;
        Packet *left = selected->gnext == selected ? NULL : selected->gnext;
        if (oldest == selected)
            oldest = left;
        ring_unlink(selected);
        packet_free(selected);
        /* the siblings, oldest first; ``oldest`` is the oldest packet still in the group */
        while (oldest != NULL && count < s->max_pop) {
            Packet *next = oldest->gnext == oldest ? NULL : oldest->gnext;
            Py_ssize_t end = PyByteArray_GET_SIZE(output);
            unsigned char *room = output_room(output, 4 + oldest->klen + oldest->plen);
            if (room == NULL || log_popped(s, oldest) < 0) {
                if (room != NULL)
                    PyByteArray_Resize(output, end);
                PyErr_Clear(); /* a shorter reply: the rest of the group stays queued */
                break;
            }
            write_record(room, oldest);
            take_popped(s, q, oldest);
            ring_unlink(oldest);
            packet_free(oldest);
            count++;
            oldest = next;
        }
        if (oldest == NULL)
            groups_delete(q, slot);
        else
            q->slots[slot] = SLOT_OF(oldest, hash);
    }
    b = (unsigned char *)PyByteArray_AS_STRING(output) + at; /* the siblings may have moved it */
    b[0] = (unsigned char)(count >> 8);
    b[1] = (unsigned char)count;
    return count;
}

/* pop_reply(queue, output) and pop_delivery(queue, output): pop_write, then the queue's
 * upkeep. */
static PyObject *pop_into(StoreObject *s, PyObject *const *args, Py_ssize_t nargs,
                          int empty_reply) {
    if (nargs != 2 || !PyByteArray_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "expected (queue, output: bytearray)");
        return NULL;
    }
    if (expire_due(s) < 0)
        return NULL;
    QueueObject *q = store_queue(s, args[0]);
    if (q == NULL && PyErr_Occurred())
        return NULL;
    Py_ssize_t count = pop_write(s, q, args[1], empty_reply);
    if (count < 0 || (count && after_pop(s, q) < 0))
        return NULL;
    return PyLong_FromSsize_t(count);
}

/* pop_reply(queue, output): a pop whose reply (u16 count, then per packet u16 key length,
 * u16 payload length, key, payload: wire.append_reply's bytes) is appended to the bytearray
 * output, with no Python object made per packet. Returns how many packets. */
static PyObject *Store_pop_reply(StoreObject *s, PyObject *const *args, Py_ssize_t nargs) {
    return pop_into(s, args, nargs, 1);
}

/* pop_delivery(queue, output): pop_reply for a subscriber's delivery: the same bytes, but
 * nothing at all when nothing is selectable (a delivery is never empty). */
static PyObject *Store_pop_delivery(StoreObject *s, PyObject *const *args, Py_ssize_t nargs) {
    return pop_into(s, args, nargs, 0);
}

/* ---------------------------------------------------------------------------------------- */
/* Push */

static int parse_u32(PyObject *value, const char *what, uint32_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s out of range", what);
        }
        return -1;
    }
    if (v > 0xFFFFFFFFull) {
        PyErr_Format(PyExc_ValueError, "%s out of range", what);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* Parse (queue, key, payload, ttl_ms, prio) into a new record with its seq; NULL on error. */
static Packet *parse_push(StoreObject *s, PyObject *const *args, uint32_t *ttl_ms) {
    PyObject *key = args[1], *payload = args[2];
    uint32_t prio;
    if (!PyBytes_Check(args[0]) || !PyBytes_Check(key) || !PyBytes_Check(payload)) {
        PyErr_SetString(PyExc_TypeError, "queue, key and payload must be bytes");
        return NULL;
    }
    if (parse_u32(args[3], "ttl_ms", ttl_ms) < 0 || parse_u32(args[4], "prio", &prio) < 0)
        return NULL;
    if (prio > 255) {
        PyErr_SetString(PyExc_ValueError, "prio out of range");
        return NULL;
    }
    Packet *p = packet_new(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key),
                           PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload));
    if (p == NULL)
        return NULL;
    p->prio = (uint8_t)prio;
    p->seq = ++s->seq;
    return p;
}

static PyObject *Store_push(StoreObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "push(queue, key, payload, ttl_ms, prio)");
        return NULL;
    }
    uint32_t ttl_ms;
    if (log_queue_fits(s, args[0]) < 0)
        return NULL;
    Packet *p = parse_push(s, args, &ttl_ms);
    if (p == NULL)
        return NULL;
    p->deadline = INFINITY;
    double now = NAN;
    if (ttl_ms) {
        now = store_now(s);
        if (now != now) {
            PyMem_Free(p);
            s->seq--;
            return NULL;
        }
        p->deadline = now + ttl_ms / 1000.0;
    }
    if (s->log_pushes != NULL) {
        int options = ttl_ms > LOG_MAX_PUSH_TTL;
        if (log_push(s, options ? LOG_OPTIONS : LOG_PUSH, args[0], p, ttl_ms, 0) < 0) {
            PyMem_Free(p);
            s->seq--;
            return NULL;
        }
    }
    QueueObject *q = store_queue_make(s, args[0]);
    if (q == NULL || file_packet(s, q, p, 1) < 0) {
        PyMem_Free(p);
        if (q != NULL)
            store_forget_if_empty(s, q);
        return NULL;
    }
    s->bytes_held += HELD(p);
    if (!p->prio)
        s->unselectable_bytes += HELD(p);
    s->pushed++;
    s->held++;
    if (!ttl_ms) {
        Py_INCREF(inf_float);
        return inf_float;
    }
    return PyFloat_FromDouble(p->deadline);
}

/* push_delayed(queue, key, payload, ttl_ms, prio, delay_ms) -> due time (decision 21). */
/* File a delayed packet p (already in the expiry heap) at the end of q's delayed ring, in
 * push order, and count it: a push_delayed's and a recovered delayed packet's filing. -1 if
 * out of memory (nothing filed, no exception set). */
static int file_delayed(StoreObject *s, QueueObject *q, Packet *p) {
    if (delayed_index(q, p) < 0)
        return -1;
    if (q->delayed_head == NULL)
        q->delayed_head = p;
    else
        ring_insert_after(q->delayed_head->gprev, p);
    q->delayed++;
    q->delayed_bytes += HELD(p);
    q->bytes += HELD(p);
    s->delayed_bytes += HELD(p);
    return 0;
}

static PyObject *Store_push_delayed(StoreObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "push_delayed(queue, key, payload, ttl_ms, prio, delay_ms)");
        return NULL;
    }
    uint32_t ttl_ms, delay_ms;
    if (parse_u32(args[5], "delay_ms", &delay_ms) < 0 || log_queue_fits(s, args[0]) < 0)
        return NULL;
    double now = store_now(s);
    if (now != now)
        return NULL;
    Packet *p = parse_push(s, args, &ttl_ms);
    if (p == NULL)
        return NULL;
    if (s->log_pushes != NULL && log_push(s, LOG_OPTIONS, args[0], p, ttl_ms, delay_ms) < 0) {
        PyMem_Free(p);
        s->seq--;
        return NULL;
    }
    QueueObject *q = store_queue_make(s, args[0]);
    p->deadline = now + delay_ms / 1000.0; /* its due time, while delayed */
    p->ttl_ms = ttl_ms;
    p->flags = F_DELAYED;
    p->queue = q;
    if (q == NULL || heap_push(&s->heap, p, 0) < 0 || file_delayed(s, q, p) < 0) {
        if (p->hpos) {
            heap_remove(&s->heap, p, 0);
            PyErr_NoMemory();
        }
        PyMem_Free(p);
        if (q != NULL)
            store_forget_if_empty(s, q);
        return NULL;
    }
    s->bytes_held += HELD(p);
    s->pushed++;
    s->held++;
    return PyFloat_FromDouble(p->deadline);
}

/* prefetch_pushes(frames, start): before a batch's frames are applied, ask the memory for
 * what their pushes will read in large key-group tables, so that at depth 1M the cache misses
 * (a slot, and the record of each entry whose tag matches) overlap instead of coming one
 * after another: first every push's home slot, then, reading those slots, the records a
 * probe will compare keys with. Pushes are the codec's 5-tuples among frames (wire.Push:
 * queue, key, payload, ttl_ms, prio); anything else is skipped. Reads only: nothing changes,
 * and the pushes are applied after, one by one, as ever. (A pop's record and slot are asked
 * for by the pop before it: prefetch_next_pops; asking for a batch's pops here measured no
 * faster.) */
#define PREFETCH_BATCH 128
#define PREFETCH_MIN_SLOTS (1u << 15) /* a smaller table stays in cache (256 KiB) */

static PyObject *Store_prefetch_pushes(StoreObject *s, PyObject *const *args,
                                       Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "prefetch_pushes(frames, start)");
        return NULL;
    }
    if (!PyList_Check(args[0])) /* the codec's lists only; anything else is left alone */
        Py_RETURN_NONE;
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    PyObject *frames = args[0], *name = NULL;
    QueueObject *q = NULL;
    struct {
        QueueObject *q;
        uint64_t hash;
    } homes[PREFETCH_BATCH];
    int n = 0;
    Py_ssize_t end = PyList_GET_SIZE(frames);
    for (Py_ssize_t i = start < 0 ? 0 : start; i < end && n < PREFETCH_BATCH; i++) {
        PyObject *frame = PyList_GET_ITEM(frames, i);
        if (!PyTuple_Check(frame) || PyTuple_GET_SIZE(frame) != 5)
            continue;
        PyObject *queue = PyTuple_GET_ITEM(frame, 0), *key = PyTuple_GET_ITEM(frame, 1);
        if (!PyBytes_Check(queue) || !PyBytes_Check(key))
            continue;
        if (queue != name) { /* the codec gives a run of pushes to one queue one name */
            name = queue;
            q = store_queue(s, queue);
            if (q == NULL && PyErr_Occurred())
                return NULL;
        }
        if (q == NULL || q->slot_cap < PREFETCH_MIN_SLOTS)
            continue;
        uint64_t hash = hash_key(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
        __builtin_prefetch(&q->slots[hash_home(hash, q->slot_cap)]);
        homes[n].q = q;
        homes[n++].hash = hash;
    }
    for (int k = 0; k < n; k++) { /* the slots have had time to arrive */
        QueueObject *qk = homes[k].q;
        uint32_t mask = qk->slot_cap - 1, at = hash_home(homes[k].hash, qk->slot_cap);
        for (Slot slot; (slot = qk->slots[at]) != 0; at = (at + 1) & mask)
            if (SLOT_HASH(slot) == (homes[k].hash & HASH_MASK))
                __builtin_prefetch(SLOT_PACKET(slot));
    }
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------- */
/* Leases: discard and restore (take is above, with pop) */

/* The bytes_held share of a sequence of packet tuples, and a check of their shape. */
static int tuples_held(PyObject *seq, int64_t *held) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    *held = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 6 ||
            !PyBytes_Check(PyTuple_GET_ITEM(t, 0)) || !PyBytes_Check(PyTuple_GET_ITEM(t, 1))) {
            PyErr_SetString(PyExc_TypeError, "packets must be the tuples take returned");
            return -1;
        }
        *held += PyBytes_GET_SIZE(PyTuple_GET_ITEM(t, 0)) +
                 PyBytes_GET_SIZE(PyTuple_GET_ITEM(t, 1)) + packet_overhead;
    }
    return 0;
}

static PyObject *Store_discard(StoreObject *s, PyObject *packets) {
    PyObject *seq = PySequence_Fast(packets, "packets must be a sequence");
    if (seq == NULL)
        return NULL;
    int64_t held;
    if (tuples_held(seq, &held) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_DECREF(seq);
    s->bytes_held -= held;
    s->taken_bytes -= held;
    Py_RETURN_NONE;
}

/* A record from a packet tuple (key, payload, prio, seq, deadline, leases). */
static Packet *packet_from_tuple(PyObject *t) {
    PyObject *key = PyTuple_GET_ITEM(t, 0), *payload = PyTuple_GET_ITEM(t, 1);
    long prio = PyLong_AsLong(PyTuple_GET_ITEM(t, 2));
    unsigned long long seq = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 3));
    double deadline = PyFloat_AsDouble(PyTuple_GET_ITEM(t, 4));
    long long leases = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 5));
    if (PyErr_Occurred())
        return NULL;
    if (prio < 0 || prio > 255) {
        PyErr_SetString(PyExc_ValueError, "prio out of range");
        return NULL;
    }
    Packet *p = packet_new(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key),
                           PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload));
    if (p == NULL)
        return NULL;
    p->prio = (uint8_t)prio;
    p->seq = seq;
    p->deadline = deadline;
    p->leases = leases < 0 ? 0 : leases > 0xFFFFFFFFll ? 0xFFFFFFFFu : (uint32_t)leases;
    return p;
}

static PyObject *Store_restore(StoreObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "restore(queue, packets)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "packets must be a sequence");
    if (seq == NULL)
        return NULL;
    int64_t held;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), back = 0;
    if (tuples_held(seq, &held) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    double now = store_now(s);
    if (now != now) {
        Py_DECREF(seq);
        return NULL;
    }
    s->taken_bytes -= held;
    QueueObject *q = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Packet *p = packet_from_tuple(PySequence_Fast_GET_ITEM(seq, i));
        if (p == NULL)
            goto error;
        if (p->deadline <= now) { /* TTL wins (decision 15) */
            s->expired++;
            s->bytes_held -= HELD(p);
            PyMem_Free(p);
            continue;
        }
        if (q == NULL && (q = store_queue_make(s, args[0])) == NULL) {
            PyMem_Free(p);
            goto error;
        }
        if (file_packet(s, q, p, 0) < 0) {
            PyMem_Free(p);
            goto error;
        }
        if (!p->prio)
            s->unselectable_bytes += HELD(p);
        s->held++;
        back++;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(back);
error:
    Py_DECREF(seq);
    if (q != NULL)
        store_forget_if_empty(s, q);
    return NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* Reads */

static PyObject *Store_peek_rank(StoreObject *s, PyObject *name) {
    if (expire_due(s) < 0)
        return NULL;
    QueueObject *q = store_queue(s, name);
    if (q == NULL && PyErr_Occurred())
        return NULL;
    Level *level = q != NULL ? best_level(q) : NULL;
    if (level == NULL)
        Py_RETURN_NONE;
    Packet *p = (Packet *)level->a[level->end - 1];
    return Py_BuildValue("(iL)", p->prio, -(long long)p->seq);
}

static PyObject *Store_next_deadline(StoreObject *s, PyObject *unused) {
    if (s->heap.n == 0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(s->heap.a[0]->deadline);
}

static PyObject *Store_expire(StoreObject *s, PyObject *unused) {
    Py_ssize_t removed = store_expire(s);
    return removed < 0 ? NULL : PyLong_FromSsize_t(removed);
}

static PyObject *Store_now(StoreObject *s, PyObject *unused) {
    return PyObject_CallNoArgs(s->clock);
}

static PyObject *Store_take_arrived(StoreObject *s, PyObject *unused) {
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL)
        return NULL;
    PyObject *names = s->arrived;
    s->arrived = fresh;
    return names;
}

static PyObject *Store_depth(StoreObject *s, PyObject *name) {
    QueueObject *q = store_queue(s, name);
    if (q == NULL && PyErr_Occurred())
        return NULL;
    return PyLong_FromLongLong(q ? q->size : 0);
}

static PyObject *Store_sizes(StoreObject *s, PyObject *unused) {
    PyObject *list = PyList_New(0), *name, *value;
    Py_ssize_t pos = 0;
    if (list == NULL)
        return NULL;
    while (PyDict_Next(s->queues, &pos, &name, &value)) {
        QueueObject *q = (QueueObject *)value;
        PyObject *row = Py_BuildValue("(OLL)", name, (long long)q->size, (long long)q->bytes);
        if (row == NULL || PyList_Append(list, row) < 0) {
            Py_XDECREF(row);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(row);
    }
    PyObject *it = PyObject_GetIter(list);
    Py_DECREF(list);
    return it;
}

/* _facts(queue): (packets, bytes, {prio: packets}, oldest seq or None, next deadline or None,
 * delayed packets), or None for a queue that holds nothing; queue_info's raw material. */
static PyObject *Store_facts(StoreObject *s, PyObject *name) {
    QueueObject *q = store_queue(s, name);
    if (q == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *by_priority = PyDict_New();
    if (by_priority == NULL)
        return NULL;
    uint64_t oldest = 0;
    for (int i = 0; i < q->nlevels; i++) {
        Level *level = &q->levels[i];
        PyObject *prio = PyLong_FromLong(level->prio);
        PyObject *n = PyLong_FromLong((long)(level->end - level->start - level->stale));
        if (prio == NULL || n == NULL || PyDict_SetItem(by_priority, prio, n) < 0) {
            Py_XDECREF(prio);
            Py_XDECREF(n);
            Py_DECREF(by_priority);
            return NULL;
        }
        Py_DECREF(prio);
        Py_DECREF(n);
        uint64_t first = ((Packet *)level->a[level->start])->seq;
        if (oldest == 0 || first < oldest)
            oldest = first;
    }
    PyObject *oldest_seq = oldest ? PyLong_FromUnsignedLongLong(oldest) : Py_NewRef(Py_None);
    PyObject *next = q->qheap.n ? PyFloat_FromDouble(q->qheap.a[0]->deadline)
                                : Py_NewRef(Py_None);
    return Py_BuildValue("(LLNNNL)", (long long)q->size, (long long)q->bytes, by_priority,
                         oldest_seq, next, (long long)q->delayed);
}

/* index_bytes(queue): what queue's indexes have allocated (its key-group table, levels and
 * expiry heap), records not included: what a drained queue gives back (for tests and tools). */
static PyObject *Store_index_bytes(StoreObject *s, PyObject *name) {
    QueueObject *q = store_queue(s, name);
    if (q == NULL)
        return PyErr_Occurred() ? NULL : PyLong_FromLong(0);
    size_t held = (size_t)q->slot_cap * sizeof(Slot) + (size_t)q->level_cap * sizeof(Level) +
                  (size_t)q->qheap.cap * sizeof(Packet *);
    for (int i = 0; i < q->nlevels; i++)
        held += (size_t)q->levels[i].cap * sizeof(Entry);
    return PyLong_FromSize_t(held);
}

static int peek_add(PyObject *found, Packet *p) {
    PyObject *t = packet_tuple(p);
    if (t == NULL || PyList_Append(found, t) < 0) {
        Py_XDECREF(t);
        return -1;
    }
    Py_DECREF(t);
    p->flags |= F_MARK;
    return 0;
}

/* queued(queue): every queued packet of queue, in push order (for tests and tools). */
static int by_seq(const void *a, const void *b);

static PyObject *Store_queued(StoreObject *s, PyObject *name) {
    QueueObject *q = store_queue(s, name);
    if (q == NULL)
        return PyErr_Occurred() ? NULL : PyList_New(0);
    Packet **all = PyMem_Malloc((q->size ? q->size : 1) * sizeof(Packet *));
    if (all == NULL)
        return PyErr_NoMemory();
    Py_ssize_t n = 0;
    for (int i = 0; i < q->nlevels; i++)
        for (uint32_t j = q->levels[i].start; j < q->levels[i].end; j++)
            if (!IS_TOMB(q->levels[i].a[j]))
                all[n++] = (Packet *)q->levels[i].a[j];
    qsort(all, n, sizeof(Packet *), by_seq);
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list != NULL && i < n; i++) {
        PyObject *t = packet_tuple(all[i]);
        if (t == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, t);
    }
    PyMem_Free(all);
    return list;
}

/* peek(queue, count): what pops would return, in order, removing nothing. */
static PyObject *Store_peek(StoreObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "peek(queue, count)");
        return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "peek count must be 0 or more");
        return NULL;
    }
    if (expire_due(s) < 0)
        return NULL;
    PyObject *found = PyList_New(0);
    QueueObject *q = store_queue(s, args[0]);
    if (found == NULL || q == NULL) {
        if (PyErr_Occurred())
            Py_CLEAR(found);
        return found;
    }
    int failed = 0;
    /* Levels in prio order, newest first; prio 0 (the first level if present) is skipped. */
    for (int i = 0; i < q->nlevels && !failed && PyList_GET_SIZE(found) < count; i++) {
        Level *level = &q->levels[i];
        if (level->prio == 0)
            continue;
        for (uint32_t j = level->end; j-- > level->start;) {
            Entry e = level->a[j];
            if (IS_TOMB(e) || (((Packet *)e)->flags & F_MARK))
                continue;
            Packet *selected = (Packet *)e;
            Packet *head = group_head(q, selected);
            /* the selected packet, then its group in push order, as a pop would take them */
            if (peek_add(found, selected) < 0) {
                failed = 1;
                break;
            }
            Py_ssize_t in_group = 1;
            Packet *p = head;
            while (PyList_GET_SIZE(found) < count && in_group < s->max_pop) {
                if (p != selected && !(p->flags & F_MARK)) {
                    if (peek_add(found, p) < 0) {
                        failed = 1;
                        break;
                    }
                    in_group++;
                }
                p = p->gnext;
                if (p == head)
                    break;
            }
            if (failed || PyList_GET_SIZE(found) == count)
                break;
        }
    }
    /* Clear the marks: every packet listed is in found, but found holds tuples, so walk the
     * groups again through the levels. */
    for (int i = 0; i < q->nlevels; i++) {
        Level *level = &q->levels[i];
        for (uint32_t j = level->start; j < level->end; j++)
            if (!IS_TOMB(level->a[j]))
                ((Packet *)level->a[j])->flags &= ~F_MARK;
    }
    if (failed)
        Py_CLEAR(found);
    return found;
}

/* ---------------------------------------------------------------------------------------- */
/* Operators: purge and move */

/* Take every packet of q (delayed ones too if with_delayed) out of the store's heap; counts
 * them. The records stay in q, which the caller frees or refiles. */
static void unheap_queue(StoreObject *s, QueueObject *q) {
    for (uint32_t i = 0; i < q->slot_cap; i++) {
        Packet *head = SLOT_PACKET(q->slots[i]);
        if (head == NULL)
            continue;
        Packet *p = head;
        do {
            if (p->hpos)
                heap_remove(&s->heap, p, 0);
            p = p->gnext;
        } while (p != head);
    }
    if (q->delayed_head != NULL) {
        Packet *p = q->delayed_head;
        do {
            heap_remove(&s->heap, p, 0);
            p = p->gnext;
        } while (p != q->delayed_head);
    }
}

static int64_t queue_unselectable(QueueObject *q) {
    Level *level = q->nlevels ? &q->levels[0] : NULL;
    int64_t held = 0;
    if (level == NULL || level->prio != 0)
        return 0;
    for (uint32_t j = level->start; j < level->end; j++)
        if (!IS_TOMB(level->a[j]))
            held += HELD((Packet *)level->a[j]);
    return held;
}

static int log_purge(StoreObject *s, QueueObject *q);

static PyObject *Store_purge(StoreObject *s, PyObject *name) {
    QueueObject *q = store_queue(s, name);
    if (q == NULL)
        return PyErr_Occurred() ? NULL : PyLong_FromLong(0);
    if (log_purge(s, q) < 0)
        return NULL;
    Py_INCREF(q);
    unheap_queue(s, q);
    int64_t removed = q->size + q->delayed;
    s->bytes_held -= q->bytes;
    s->unselectable_bytes -= queue_unselectable(q);
    s->delayed_bytes -= q->delayed_bytes;
    s->purged += removed;
    s->held -= removed;
    int failed = store_drop_queue(s, q) < 0;
    Py_DECREF(q); /* frees the records */
    return failed ? NULL : PyLong_FromLongLong(removed);
}

static int by_seq(const void *a, const void *b) {
    uint64_t x = (*(Packet *const *)a)->seq, y = (*(Packet *const *)b)->seq;
    return x < y ? -1 : x > y;
}


/* A purge's remove entries, in seq order (queued and delayed packets alike). */
static int log_purge(StoreObject *s, QueueObject *q) {
    if (s->log_pushes == NULL)
        return 0;
    Py_ssize_t n = 0, total = q->size + q->delayed;
    Packet **all = PyMem_Malloc((total ? total : 1) * sizeof(Packet *));
    if (all == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < q->slot_cap; i++) {
        Packet *head = SLOT_PACKET(q->slots[i]), *p = head;
        if (head != NULL)
            do {
                all[n++] = p;
                p = p->gnext;
            } while (p != head);
    }
    if (q->delayed_head != NULL) {
        Packet *p = q->delayed_head;
        do {
            all[n++] = p;
            p = p->gnext;
        } while (p != q->delayed_head);
    }
    qsort(all, n, sizeof(Packet *), by_seq);
    int failed = log_removals(s, all, n);
    PyMem_Free(all);
    return failed;
}

/* Before a move files its packets (``moving``, in seq order, old seqs still theirs): their
 * remove entries, and the offset from the store's clock to the wall clock for their deadlines
 * (persistence/store.py's LoggedStore._moved). */
static int log_move_start(StoreObject *s, Packet **moving, Py_ssize_t n, double *to_wall) {
    if (s->log_pushes == NULL)
        return 0;
    if (log_removals(s, moving, n) < 0 || log_block_start(s) < 0)
        return -1;
    double wall = store_wall(s);
    if (wall != wall)
        return -1;
    double now = store_now(s);
    if (now != now)
        return -1;
    *to_wall = wall - now;
    return 0;
}

/* A moved entry for p (its new seq given): a push made now, keeping its wall-clock deadline. */
static int log_moved(StoreObject *s, PyObject *target, const Packet *p, double to_wall) {
    uint64_t deadline_ms = p->deadline == INFINITY ? 0 : (uint64_t)((p->deadline + to_wall) * 1000);
    return log_push(s, LOG_MOVED, target, p, deadline_ms, 0);
}

/* move(source, target, limit) (decision 22): queued packets of source enter target as pushes
 * made now, in their old relative order, keeping key, payload, prio and TTL deadline; their
 * lease counts start again. limit 0: all of them; else whole groups, in pop order, while
 * fewer than limit have moved. Delayed packets stay. Returns how many moved. */
static PyObject *Store_move(StoreObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "move(source, target, limit)");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    if (limit < 0) {
        PyErr_SetString(PyExc_ValueError, "limit must be 0 (all) or more");
        return NULL;
    }
    int same = PyObject_RichCompareBool(args[0], args[1], Py_EQ);
    if (same < 0)
        return NULL;
    if (same) {
        PyErr_SetString(PyExc_ValueError, "a queue cannot be moved into itself");
        return NULL;
    }
    if (log_queue_fits(s, args[1]) < 0)
        return NULL;
    if (expire_due(s) < 0)
        return NULL;
    QueueObject *q = store_queue(s, args[0]);
    if (q == NULL)
        return PyErr_Occurred() ? NULL : PyLong_FromLong(0);
    Py_INCREF(q);
    Py_ssize_t room = q->size, n = 0;
    Packet **moving = PyMem_Malloc((room ? room : 1) * sizeof(Packet *));
    if (moving == NULL) {
        Py_DECREF(q);
        return PyErr_NoMemory();
    }
    /* The packets stay held: the store's totals change only by the prio-0 bytes that move
     * (they count again in the target) */
    long long held_before = s->bytes_held, count_before = s->held;
    long long unselectable_before = s->unselectable_bytes;
    int64_t riders_before = queue_unselectable(q);
    if (limit == 0) {
        for (uint32_t i = 0; i < q->slot_cap; i++) {
            Packet *head = SLOT_PACKET(q->slots[i]);
            if (head == NULL)
                continue;
            Packet *p = head;
            do {
                moving[n++] = p;
                p = p->gnext;
            } while (p != head);
        }
        for (Py_ssize_t i = 0; i < n; i++)
            unfile_packet(s, q, moving[i]);
    } else {
        while (n < limit) {
            Py_ssize_t got = take_group(s, q, moving + n, PY_SSIZE_T_MAX); /* whole groups */
            if (got == 0)
                break;
            n += got;
        }
    }
    s->bytes_held = held_before;
    s->held = count_before;
    s->unselectable_bytes = unselectable_before - (riders_before - queue_unselectable(q));
    int failed = 0;
    QueueObject *target = NULL;
    double to_wall = 0.0;
    if (n) {
        qsort(moving, n, sizeof(Packet *), by_seq);
        target = store_queue_make(s, args[1]);
        failed = target == NULL || log_move_start(s, moving, n, &to_wall) < 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Packet *p = moving[i];
        p->seq = ++s->seq;
        p->leases = 0;
        if (!failed && s->log_pushes != NULL && log_moved(s, args[1], p, to_wall) < 0)
            failed = 1;
        if (failed || file_packet(s, target, p, 1) < 0) { /* out of memory: the packet is lost */
            failed = 1;
            s->bytes_held -= HELD(p);
            s->held--;
            PyMem_Free(p);
            continue;
        }
        if (!p->prio)
            s->unselectable_bytes += HELD(p);
    }
    PyMem_Free(moving);
    if (store_forget_if_empty(s, q) < 0)
        failed = 1;
    Py_DECREF(q);
    if (failed)
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    return PyLong_FromSsize_t(n);
}


/* ---------------------------------------------------------------------------------------- */
/* Load and holds (persistence: recovery's bulk insert, compaction's question) */

/* Hold a loaded delayed packet until ``due`` (push_delayed's filing; ``deadline``: its TTL
 * deadline, INFINITY for none, kept as the TTL counted from its due time). */
static int load_delayed(StoreObject *s, QueueObject *q, Packet *p, double due, double deadline) {
    p->deadline = due;
    if (deadline != INFINITY) {
        long long ttl = llround((deadline - due) * 1000);
        p->ttl_ms = ttl < 1 ? 1 : ttl > 0xFFFFFFFFll ? 0xFFFFFFFFu : (uint32_t)ttl;
    }
    p->flags = F_DELAYED;
    p->queue = q;
    if (heap_push(&s->heap, p, 0) < 0)
        return -1;
    if (file_delayed(s, q, p) < 0) {
        heap_remove(&s->heap, p, 0);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* A float from a dict of seq -> time, or ``otherwise`` if seq is not in it; -1 on error. */
static int time_of(PyObject *times, PyObject *seq, double otherwise, double *out) {
    *out = otherwise;
    if (times == Py_None)
        return 0;
    PyObject *value = PyDict_GetItemWithError(times, seq);
    if (value == NULL)
        return PyErr_Occurred() ? -1 : 0;
    *out = PyFloat_AsDouble(value);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* One loaded packet (queue, key, payload, prio, seq), filed as push or push_delayed would;
 * ``last``: the previous one's seq, which it must follow. */
static int load_one(StoreObject *s, PyObject *t, PyObject *deadlines, PyObject *delayed,
                    uint64_t *last) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 5 || !PyBytes_Check(PyTuple_GET_ITEM(t, 0)) ||
        !PyBytes_Check(PyTuple_GET_ITEM(t, 1)) || !PyBytes_Check(PyTuple_GET_ITEM(t, 2))) {
        PyErr_SetString(PyExc_TypeError, "load takes (queue, key, payload, prio, seq) tuples");
        return -1;
    }
    PyObject *queue = PyTuple_GET_ITEM(t, 0), *key = PyTuple_GET_ITEM(t, 1);
    PyObject *payload = PyTuple_GET_ITEM(t, 2), *seq_obj = PyTuple_GET_ITEM(t, 4);
    long prio = PyLong_AsLong(PyTuple_GET_ITEM(t, 3));
    unsigned long long seq = PyLong_AsUnsignedLongLong(seq_obj);
    if (PyErr_Occurred())
        return -1;
    if (prio < 0 || prio > 255) {
        PyErr_SetString(PyExc_ValueError, "prio out of range");
        return -1;
    }
    if (seq <= *last) {
        PyErr_Format(PyExc_ValueError, "loading seq %llu after seq %llu: not in push order", seq,
                     (unsigned long long)*last);
        return -1;
    }
    double deadline, due;
    if (time_of(deadlines, seq_obj, INFINITY, &deadline) < 0 ||
        time_of(delayed, seq_obj, NAN, &due) < 0)
        return -1;
    QueueObject *q = store_queue_make(s, queue);
    if (q == NULL)
        return -1;
    Packet *p = packet_new(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key),
                           PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload));
    if (p == NULL)
        return -1;
    p->prio = (uint8_t)prio;
    p->seq = seq;
    p->deadline = deadline;
    int failed = due == due ? load_delayed(s, q, p, due, deadline) : file_packet(s, q, p, 1);
    if (failed < 0) {
        PyMem_Free(p);
        store_forget_if_empty(s, q);
        return -1;
    }
    if (due != due && !p->prio)
        s->unselectable_bytes += HELD(p);
    s->bytes_held += HELD(p);
    s->pushed++;
    s->held++;
    *last = seq;
    return 0;
}

/* _load(packets, deadlines, delayed, last_seq): store.QueueStore.load's filing (its docstring
 * says what each argument holds; deadlines and delayed may be None), into a store no push
 * has touched. Pushes then go on after last_seq. */
static PyObject *Store_load(StoreObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || (args[1] != Py_None && !PyDict_Check(args[1])) ||
        (args[2] != Py_None && !PyDict_Check(args[2]))) {
        PyErr_SetString(PyExc_TypeError, "_load(packets, deadlines: dict, delayed: dict, last_seq)");
        return NULL;
    }
    unsigned long long last_seq = PyLong_AsUnsignedLongLong(args[3]);
    if (last_seq == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (s->seq) {
        PyErr_SetString(PyExc_RuntimeError, "load is for a store no push has touched");
        return NULL;
    }
    PyObject *it = PyObject_GetIter(args[0]), *t;
    if (it == NULL)
        return NULL;
    uint64_t last = 0;
    while ((t = PyIter_Next(it)) != NULL) {
        int failed = load_one(s, t, args[1], args[2], &last);
        Py_DECREF(t);
        if (failed < 0)
            break;
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    if (last_seq < last) {
        PyErr_Format(PyExc_ValueError, "last_seq %llu is before the last packet's seq %llu",
                     last_seq, (unsigned long long)last);
        return NULL;
    }
    s->seq = last_seq;
    Py_RETURN_NONE;
}

/* Whether packet seq, pushed to queue with key, is still queued, or delayed for queue: 1 or
 * 0, -1 on error. O(packets of its key). */
static int store_holds(StoreObject *s, PyObject *queue, PyObject *key, PyObject *seq_) {
    unsigned long long seq = PyLong_AsUnsignedLongLong(seq_);
    if (seq == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    QueueObject *q = store_queue(s, queue);
    if (q == NULL)
        return PyErr_Occurred() ? -1 : 0;
    Packet *head = NULL;
    if (q->groups)
        head = SLOT_PACKET(q->slots[group_slot(q, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))]);
    for (Packet *p = head; p != NULL; p = p->gnext == head ? NULL : p->gnext)
        if (p->seq == seq)
            return 1;
    return delayed_find(q, seq) != NULL;
}

/* locate(queue, key, seq): compaction's question (persistence/compaction.py's Locate) in one
 * C call: queue if the store holds the packet (store_holds); else the queue it was leased
 * from if it is leased (attach_log's taken); else None. */
static PyObject *Store_locate(StoreObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "locate(queue, key: bytes, seq)");
        return NULL;
    }
    int held = store_holds(s, args[0], args[1], args[2]);
    if (held)
        return held < 0 ? NULL : Py_NewRef(args[0]);
    if (s->taken == NULL || !PyDict_GET_SIZE(s->taken))
        Py_RETURN_NONE;
    PyObject *taken_from = PyDict_GetItemWithError(s->taken, args[2]); /* borrowed */
    if (taken_from == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    return Py_NewRef(taken_from);
}

/* _live_seqs(): the seqs of every packet held, queued or delayed (not leased), in no order;
 * for the log's check_invariants. */
static PyObject *Store_live_seqs(StoreObject *s, PyObject *unused) {
    PyObject *seqs = PyList_New(0), *name, *value;
    Py_ssize_t pos = 0;
    while (seqs != NULL && PyDict_Next(s->queues, &pos, &name, &value)) {
        QueueObject *q = (QueueObject *)value;
        for (uint32_t i = 0; i <= q->slot_cap; i++) { /* every key group, then the delayed */
            Packet *head = i < q->slot_cap ? SLOT_PACKET(q->slots[i]) : q->delayed_head;
            for (Packet *p = head; p != NULL; p = p->gnext == head ? NULL : p->gnext) {
                PyObject *seq = PyLong_FromUnsignedLongLong(p->seq);
                if (seq == NULL || PyList_Append(seqs, seq) < 0) {
                    Py_XDECREF(seq);
                    Py_CLEAR(seqs);
                    return NULL;
                }
                Py_DECREF(seq);
            }
        }
    }
    return seqs;
}

/* ---------------------------------------------------------------------------------------- */
/* check_invariants: for tests */

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            PyErr_Format(PyExc_AssertionError, __VA_ARGS__);                               \
            return -1;                                                                     \
        }                                                                                  \
    } while (0)

static int check_heap(Heap *h, int qh) {
    for (uint32_t i = 0; i < h->n; i++) {
        CHECK(*heap_pos(h->a[i], qh) == i + 1, "heap position wrong at %u", i);
        CHECK(i == 0 || !earlier(h->a[i], h->a[(i - 1) / 2]), "not a heap at %u", i);
    }
    return 0;
}

static int check_queue(StoreObject *s, PyObject *name, QueueObject *q, int64_t *count,
                       int64_t *held, int64_t *unselectable, int64_t *ttl) {
    CHECK(q->size > 0 || q->delayed > 0, "a queue holding nothing is remembered");
    CHECK(PyObject_RichCompareBool(name, q->name, Py_EQ) == 1, "queue filed under another name");
    int64_t size = 0, bytes = 0, qttl = 0;
    uint32_t groups = 0;
    for (uint32_t i = 0; i < q->slot_cap; i++) {
        Packet *head = SLOT_PACKET(q->slots[i]);
        if (head == NULL)
            continue;
        groups++;
        CHECK(group_slot(q, KEY(head), head->klen) == i, "group not where its key hashes");
        CHECK(q->slots[i] == SLOT_OF(head, hash_key(KEY(head), head->klen)), "slot's tag wrong");
        Packet *p = head;
        do {
            CHECK(p->queue == q, "packet names another queue");
            CHECK(!(p->flags & F_DELAYED), "a delayed packet in a key group");
            CHECK(key_is(p, KEY(head), head->klen), "packet in another key's group");
            CHECK(p->gnext->gprev == p, "group links broken");
            CHECK(p->gnext == head || p->gnext->seq > p->seq, "group out of push order");
            Level *level = level_of(q, p->prio);
            CHECK(level != NULL, "no level for a live packet's prio");
            uint32_t at = level_bisect(level, p->seq);
            CHECK(at < level->end && level->a[at] == (Entry)p, "live packet not in its level");
            CHECK((p->deadline != INFINITY) == (p->hpos != 0), "store heap entry wrong");
            CHECK((p->deadline != INFINITY) == (p->qhpos != 0), "queue heap entry wrong");
            qttl += p->deadline != INFINITY;
            size++;
            bytes += HELD(p);
            if (!p->prio)
                *unselectable += HELD(p);
            p = p->gnext;
        } while (p != head);
    }
    CHECK(groups == q->groups, "group count wrong");
    CHECK(q->groups * 4 <= q->slot_cap * 3, "group table too full");
    CHECK(q->slot_cap <= MIN_SLOTS || (uint64_t)q->groups * 8 >= q->slot_cap,
          "a drained group table was not given back");
    CHECK(size == q->size, "queue size %lld, counted %lld", (long long)q->size, (long long)size);
    int64_t entries = 0, delayed = 0, delayed_bytes = 0;
    uint64_t mask[4] = {0, 0, 0, 0};
    for (int i = 0; i < q->nlevels; i++) {
        Level *level = &q->levels[i];
        CHECK(i == 0 || level->prio > q->levels[i - 1].prio, "levels out of order");
        mask[level->prio >> 6] |= 1ull << (level->prio & 63);
        CHECK(level->end > level->start, "empty level %d", level->prio);
        CHECK(!IS_TOMB(level->a[level->start]) && !IS_TOMB(level->a[level->end - 1]),
              "a level ends in a tombstone");
        uint32_t stale = 0;
        for (uint32_t j = level->start; j < level->end; j++) {
            Entry e = level->a[j];
            CHECK(j == level->start || ENTRY_SEQ(e) > ENTRY_SEQ(level->a[j - 1]),
                  "level out of push order");
            if (IS_TOMB(e))
                stale++;
            else
                CHECK(((Packet *)e)->prio == level->prio && ((Packet *)e)->queue == q,
                      "packet in the wrong level");
        }
        CHECK(stale == level->stale, "stale count wrong");
        entries += level->end - level->start;
    }
    CHECK(memcmp(mask, q->mask, sizeof(mask)) == 0, "mask disagrees with levels");
    CHECK(entries == q->entries, "entries count wrong");
    CHECK(entries - q->size >= 0, "fewer level entries than packets");
    CHECK(q->entries <= 2 * q->size + STALE_SLACK + 1, "tombstones not compacted");
    if (check_heap(&q->qheap, 1) < 0)
        return -1;
    CHECK(q->qheap.n == qttl, "queue heap holds %u, %lld packets have a TTL", q->qheap.n,
          (long long)qttl);
    if (q->delayed_head != NULL) {
        Packet *p = q->delayed_head;
        do {
            CHECK(p->flags & F_DELAYED, "an undelayed packet in the delayed list");
            CHECK(delayed_find(q, p->seq) == p, "a delayed packet not indexed by its seq");
            CHECK(p->hpos != 0 && p->qhpos == 0, "delayed packet's heap entries wrong");
            CHECK(p->queue == q, "delayed packet names another queue");
            delayed++;
            delayed_bytes += HELD(p);
            p = p->gnext;
        } while (p != q->delayed_head);
    }
    CHECK(delayed == q->delayed && delayed_bytes == q->delayed_bytes, "delayed count wrong");
    uint32_t indexed = 0;
    for (uint32_t i = 0; i < q->dslot_cap; i++)
        indexed += q->dslots[i] != NULL;
    CHECK(indexed == q->delayed, "delayed index holds %u, %lld packets delayed", indexed,
          (long long)q->delayed);
    CHECK(q->dslot_cap == 0 || (uint64_t)q->delayed * 2 <= q->dslot_cap, "delayed index full");
    CHECK(bytes + delayed_bytes == q->bytes, "queue bytes wrong");
    *count += size + delayed;
    *held += q->bytes;
    *ttl += qttl + delayed;
    return 0;
}

static PyObject *Store_check_invariants(StoreObject *s, PyObject *unused) {
    PyObject *name, *value;
    Py_ssize_t pos = 0;
    int64_t count = 0, held = 0, unselectable = 0, ttl = 0, delayed_bytes = 0;
    while (PyDict_Next(s->queues, &pos, &name, &value)) {
        if (check_queue(s, name, (QueueObject *)value, &count, &held, &unselectable, &ttl) < 0)
            return NULL;
        delayed_bytes += ((QueueObject *)value)->delayed_bytes;
    }
    if (check_heap(&s->heap, 0) < 0)
        return NULL;
#undef CHECK
#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            PyErr_Format(PyExc_AssertionError, __VA_ARGS__);                               \
            return NULL;                                                                   \
        }                                                                                  \
    } while (0)
    CHECK(s->heap.n == ttl, "store heap holds %u entries for %lld packets", s->heap.n,
          (long long)ttl);
    CHECK(count == s->held, "count %lld but %lld packets held", s->held, (long long)count);
    CHECK(held + s->taken_bytes == s->bytes_held, "bytes_held %lld", s->bytes_held);
    CHECK(unselectable == s->unselectable_bytes, "unselectable_bytes is wrong");
    CHECK(delayed_bytes == s->delayed_bytes, "delayed_bytes is wrong");
    Py_RETURN_NONE;
}
#undef CHECK

/* ---------------------------------------------------------------------------------------- */
/* The type */

static int Store_init(StoreObject *s, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"clock", "max_pop", NULL};
    PyObject *clock;
    Py_ssize_t max_pop = MAX_POP_LIMIT;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$n", names, &clock, &max_pop))
        return -1;
    if (max_pop < 1 || max_pop > MAX_POP_LIMIT) {
        PyErr_Format(PyExc_ValueError, "max_pop must be 1..65535, not %zd", max_pop);
        return -1;
    }
    if (s->queues != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a store is initialised once");
        return -1;
    }
    Py_INCREF(clock);
    s->clock = clock;
    s->max_pop = max_pop;
    s->queues = PyDict_New();
    s->arrived = PyList_New(0);
    return s->queues && s->arrived ? 0 : -1;
}

static void free_all(StoreObject *s) {
    PyMem_Free(s->heap.a);
    s->heap.a = NULL;
    s->heap.n = s->heap.cap = 0;
}

static int Store_traverse(StoreObject *s, visitproc visit, void *arg) {
    Py_VISIT(s->clock);
    Py_VISIT(s->dict);
    Py_VISIT(s->log_pushes);
    Py_VISIT(s->log_removals);
    Py_VISIT(s->wall_clock);
    Py_VISIT(s->taken);
    return 0;
}

static int Store_clear(StoreObject *s) {
    Py_CLEAR(s->clock);
    Py_CLEAR(s->dict);
    Py_CLEAR(s->log_pushes);
    Py_CLEAR(s->log_removals);
    Py_CLEAR(s->wall_clock);
    Py_CLEAR(s->taken);
    return 0;
}

static void Store_dealloc(StoreObject *s) {
    PyObject_GC_UnTrack(s);
    Store_clear(s);
    s->last_queue = NULL;
    Py_CLEAR(s->last_name);
    Py_CLEAR(s->queues); /* queues free their records */
    Py_CLEAR(s->arrived);
    free_all(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static Py_ssize_t Store_len(StoreObject *s) {
    return (Py_ssize_t)s->held;
}

static PyObject *Store_get_pushed(StoreObject *s, void *unused) {
    return PyLong_FromLongLong(s->pushed);
}

static PyObject *Store_get_queue_count(StoreObject *s, void *unused) {
    return PyLong_FromSsize_t(PyDict_GET_SIZE(s->queues));
}

static PyObject *Store_get_seq(StoreObject *s, void *unused) {
    return PyLong_FromUnsignedLongLong(s->seq);
}

static PyObject *Store_get_max_pop(StoreObject *s, void *unused) {
    return PyLong_FromSsize_t(s->max_pop);
}

static PyGetSetDef Store_getset[] = {
    {"pushed", (getter)Store_get_pushed, NULL, "Packets pushed since the store was made.", NULL},
    {"queue_count", (getter)Store_get_queue_count, NULL, "Queues holding packets.", NULL},
    {"_seq", (getter)Store_get_seq, NULL, "The last seq given.", NULL},
    {"_max_pop", (getter)Store_get_max_pop, NULL, "Most packets one pop returns.", NULL},
    {"_block_wall", (getter)Store_get_block_wall, NULL,
     "The wall clock at the log's open block's first push.", NULL},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyMemberDef Store_members[] = {
    {"bytes_held", T_LONGLONG, offsetof(StoreObject, bytes_held), 0, NULL},
    {"unselectable_bytes", T_LONGLONG, offsetof(StoreObject, unselectable_bytes), 0, NULL},
    {"expired", T_LONGLONG, offsetof(StoreObject, expired), 0, NULL},
    {"purged", T_LONGLONG, offsetof(StoreObject, purged), 0, NULL},
    {"taken_bytes", T_LONGLONG, offsetof(StoreObject, taken_bytes), 0, NULL},
    {"delayed_bytes", T_LONGLONG, offsetof(StoreObject, delayed_bytes), READONLY, NULL},
    {"_clock", T_OBJECT, offsetof(StoreObject, clock), READONLY, NULL},
    {NULL},
};

static PyMethodDef Store_methods[] = {
    {"push", (PyCFunction)(void (*)(void))Store_push, METH_FASTCALL,
     "push(queue, key, payload, ttl_ms, prio) -> deadline (inf for TTL 0)"},
    {"push_delayed", (PyCFunction)(void (*)(void))Store_push_delayed, METH_FASTCALL,
     "push_delayed(queue, key, payload, ttl_ms, prio, delay_ms) -> due time"},
    {"prefetch_pushes", (PyCFunction)(void (*)(void))Store_prefetch_pushes, METH_FASTCALL,
     "prefetch_pushes(frames, start): before a batch, ask the memory for what its pushes read"},
    {"pop", (PyCFunction)Store_pop, METH_O, "pop(queue) -> the best packet and its key group"},
    {"pop_reply", (PyCFunction)(void (*)(void))Store_pop_reply, METH_FASTCALL,
     "pop_reply(queue, output) -> count: a pop whose reply bytes are appended to output"},
    {"pop_delivery", (PyCFunction)(void (*)(void))Store_pop_delivery, METH_FASTCALL,
     "pop_delivery(queue, output) -> count: pop_reply, writing nothing if nothing was popped"},
    {"take", (PyCFunction)Store_take, METH_O, "take(queue): a pop whose bytes stay held"},
    {"discard", (PyCFunction)Store_discard, METH_O, "discard(packets): an ack"},
    {"restore", (PyCFunction)(void (*)(void))Store_restore, METH_FASTCALL,
     "restore(queue, packets) -> how many went back"},
    {"peek_rank", (PyCFunction)Store_peek_rank, METH_O, "peek_rank(queue) -> (prio, -seq)"},
    {"next_deadline", (PyCFunction)Store_next_deadline, METH_NOARGS, "next_deadline()"},
    {"expire", (PyCFunction)Store_expire, METH_NOARGS, "expire() -> how many expired"},
    {"now", (PyCFunction)Store_now, METH_NOARGS, "now(): the store's clock"},
    {"take_arrived", (PyCFunction)Store_take_arrived, METH_NOARGS,
     "take_arrived() -> queues delayed packets entered since the last call"},
    {"depth", (PyCFunction)Store_depth, METH_O, "depth(queue) -> live packets"},
    {"sizes", (PyCFunction)Store_sizes, METH_NOARGS, "sizes() -> (name, packets, bytes)"},
    {"_facts", (PyCFunction)Store_facts, METH_O, "queue_info's raw material"},
    {"queued", (PyCFunction)Store_queued, METH_O,
     "queued(queue) -> every queued packet, in push order; O(packets), for tests and tools"},
    {"peek", (PyCFunction)(void (*)(void))Store_peek, METH_FASTCALL, "peek(queue, count)"},
    {"index_bytes", (PyCFunction)Store_index_bytes, METH_O,
     "index_bytes(queue) -> bytes its group table, levels and heap hold; for tests and tools"},
    {"purge", (PyCFunction)Store_purge, METH_O, "purge(queue) -> how many"},
    {"move", (PyCFunction)(void (*)(void))Store_move, METH_FASTCALL,
     "move(source, target, limit) -> how many moved"},
    {"attach_log", (PyCFunction)(void (*)(void))Store_attach_log, METH_FASTCALL,
     "attach_log(pushes, removals, wall_clock): log into a journal's open block"},
    {"frame_block", (PyCFunction)Store_frame_block, METH_O,
     "frame_block(seq_base) -> the open block as a whole block (None if empty); clears it"},
    {"frame_into", (PyCFunction)(void (*)(void))Store_frame_into, METH_FASTCALL,
     "frame_into(seq_base, buffer, at) -> bytes framed into buffer at at (0: empty block; "
     "-1: it would not fit, nothing framed)"},
    {"_load", (PyCFunction)(void (*)(void))Store_load, METH_FASTCALL,
     "_load(packets, deadlines, delayed, last_seq): recovery's bulk insert"},
    {"locate", (PyCFunction)(void (*)(void))Store_locate, METH_FASTCALL,
     "locate(queue, key, seq) -> the queue that packet is in, queued, delayed or leased"},
    {"_live_seqs", (PyCFunction)Store_live_seqs, METH_NOARGS,
     "_live_seqs() -> the seqs of every packet held; for tests"},
    {"check_invariants", (PyCFunction)Store_check_invariants, METH_NOARGS,
     "assert the internal structures agree; for tests"},
    {NULL},
};

static PySequenceMethods Store_as_sequence = {
    .sq_length = (lenfunc)Store_len,
};

static PyTypeObject StoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pinpriq._packed.PackedCore",
    .tp_doc = "The packed store's C core; pinpriq.packed.PackedStore is the store.",
    .tp_basicsize = sizeof(StoreObject),
    .tp_dictoffset = offsetof(StoreObject, dict),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Store_init,
    .tp_dealloc = (destructor)Store_dealloc,
    .tp_traverse = (traverseproc)Store_traverse,
    .tp_clear = (inquiry)Store_clear,
    .tp_methods = Store_methods,
    .tp_members = Store_members,
    .tp_getset = Store_getset,
    .tp_as_sequence = &Store_as_sequence,
};

/* _spare_records() -> how many freed records wait for reuse (packet_free); for tests. */
static PyObject *spare_records(PyObject *unused_module, PyObject *unused) {
    Py_ssize_t total = 0;
    for (int i = 0; i < SPARE_CLASSES; i++)
        total += spare_count[i];
    return PyLong_FromSsize_t(total);
}

/* count_removals(removed, firsts, copied_to) -> (counts, moved): for the journal's segment
 * counts (journal.py's _count_removals, which this does in one C loop). removed: remove
 * entries (9 bytes each: kind, u64 seq); firsts: the segments' first seqs, ascending;
 * copied_to: seq -> the segment compaction copied it to. A seq in copied_to is taken out of
 * it and its segment appended to moved; any other is counted in counts (one per segment)
 * against the segment whose seqs it falls in. */
static PyObject *count_removals(PyObject *unused_module, PyObject *const *args,
                                Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "count_removals(removed, firsts: list, copied_to: dict)");
        return NULL;
    }
    Py_buffer removed;
    if (PyObject_GetBuffer(args[0], &removed, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *firsts = args[1], *copied_to = args[2], *out = NULL, *moved = NULL;
    Py_ssize_t nseg = PyList_GET_SIZE(firsts);
    uint64_t *first = PyMem_Malloc((size_t)(nseg ? nseg : 1) * sizeof(uint64_t));
    Py_ssize_t *count = PyMem_Calloc((size_t)(nseg ? nseg : 1), sizeof(Py_ssize_t));
    if (first == NULL || count == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nseg; i++) {
        first[i] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(firsts, i));
        if (first[i] == (uint64_t)-1 && PyErr_Occurred())
            goto done;
    }
    out = PyList_New(nseg);
    moved = PyList_New(0);
    if (out == NULL || moved == NULL)
        goto fail;
    const unsigned char *b = removed.buf;
    for (Py_ssize_t at = 0; at + 9 <= removed.len; at += 9) {
        uint64_t seq = 0;
        for (int k = 1; k <= 8; k++)
            seq = seq << 8 | b[at + k];
        if (PyDict_GET_SIZE(copied_to)) {
            PyObject *key = PyLong_FromUnsignedLongLong(seq);
            if (key == NULL)
                goto fail;
            PyObject *segment = PyDict_GetItemWithError(copied_to, key); /* borrowed */
            int failed = segment == NULL && PyErr_Occurred();
            if (segment != NULL && (PyList_Append(moved, segment) < 0 ||
                                    PyDict_DelItem(copied_to, key) < 0))
                failed = 1;
            Py_DECREF(key);
            if (failed)
                goto fail;
            if (segment != NULL)
                continue;
        }
        /* the last segment whose first seq is at most seq (bisect_right, minus one) */
        Py_ssize_t lo = 0, hi = nseg;
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            if (first[mid] <= seq)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo == 0) {
            PyErr_Format(PyExc_ValueError, "a removed seq %llu before the first segment's",
                         (unsigned long long)seq);
            goto fail;
        }
        count[lo - 1]++;
    }
    for (Py_ssize_t i = 0; i < nseg; i++) {
        PyObject *n = PyLong_FromSsize_t(count[i]);
        if (n == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, n);
    }
    PyMem_Free(first);
    PyMem_Free(count);
    PyBuffer_Release(&removed);
    return Py_BuildValue("(NN)", out, moved);
fail:
    Py_XDECREF(out);
    Py_XDECREF(moved);
    out = NULL;
done:
    PyMem_Free(first);
    PyMem_Free(count);
    PyBuffer_Release(&removed);
    return out;
}

static PyMethodDef module_methods[] = {
    {"_spare_records", spare_records, METH_NOARGS,
     "_spare_records() -> freed records kept for reuse; for tests"},
    {"count_removals", (PyCFunction)(void (*)(void))count_removals, METH_FASTCALL,
     "count_removals(removed, firsts, copied_to) -> (removals per segment, copied ones' segments)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pinpriq._packed", "The packed packet store's C core.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__packed(void) {
    if (PyType_Ready(&QueueType) < 0 || PyType_Ready(&StoreType) < 0)
        return NULL;
    inf_float = PyFloat_FromDouble(INFINITY);
    crc_init();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&StoreType);
    if (PyModule_AddObject(m, "PackedCore", (PyObject *)&StoreType) < 0 ||
        PyModule_AddIntConstant(m, "PACKET_OVERHEAD", PACKET_OVERHEAD) < 0)
        return NULL;
    return m;
}
