/* The page index's keys (stored form, hashing), its key table (open addressing of slot numbers,
 * linear probing, backward-shift deletion) and the table of live records by slot. */
#include "page_index_parts.h"

/* ---------------------------------------------------------------- keys and hashing */

/* Each byte's value as a lowercase hex digit, -1 for any other byte; filled at import
 * (page_index_register). A table, not a comparison per digit: on random keys those branches
 * mispredict about once a digit, which made decoding most of a long lookup's time. */
static int8_t hex_value[256];

void hex_value_fill(void) {
    for (int c = 0; c < 256; c++)
        hex_value[c] = (int8_t)(c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1);
}

/* The stored form of a key: a 64-character lowercase hex key as its 32 bytes. */
void key_encode(pkey_t *k, const uint8_t *data, size_t len) {
    k->hex = 0;
    if (len == 64) {
        int bad = 0;   /* any digit's -1 makes it negative */
        for (size_t i = 0; i < 32; i++) {
            int hi = hex_value[data[2 * i]], lo = hex_value[data[2 * i + 1]];
            bad |= hi | lo;
            k->bytes[i] = (uint8_t)((unsigned)hi << 4 | (unsigned)lo);   /* unused unless every digit is one */
        }
        if (bad >= 0) {
            k->hex = 1;
            k->data = k->bytes;
            k->len = 32;
            return;
        }
    }
    k->data = data;
    k->len = len;
}

uint64_t key_hash(const index_t *self, uint32_t ns, const uint8_t *data, size_t len, int hex) {
    uint64_t h = self->seed ^ mix64((uint64_t)ns << 1 | (uint64_t)hex) ^ len;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, data + i, 8);
        h = mix64(h ^ w) + i;
    }
    if (i < len) {
        uint64_t w = 0;
        memcpy(&w, data + i, len - i);
        h = mix64(h ^ w ^ UINT64_C(0x9e3779b97f4a7c15));
    }
    return mix64(h);
}

uint64_t page_hash(const index_t *self, const page_t *p) {
    return key_hash(self, p->ns, page_key(p), p->key_len, (p->flags & F_HEX) != 0);
}

int page_matches(const page_t *p, uint32_t ns, const pkey_t *k) {
    return p->ns == ns && p->key_len == k->len && ((p->flags & F_HEX) != 0) == k->hex
           && memcmp(page_key(p), k->data, k->len) == 0;
}

PyObject *page_key_object(const page_t *p) {
    const uint8_t *data = page_key(p);
    if (!(p->flags & F_HEX))
        return PyBytes_FromStringAndSize((const char *)data, p->key_len);
    static const char digits[] = "0123456789abcdef";
    PyObject *out = PyBytes_FromStringAndSize(NULL, 64);
    if (!out)
        return NULL;
    char *s = PyBytes_AS_STRING(out);
    for (int i = 0; i < 32; i++) {
        s[2 * i] = digits[data[i] >> 4];
        s[2 * i + 1] = digits[data[i] & 15];
    }
    return out;
}

/* ---------------------------------------------------------------- the key table */

uint32_t table_find(const index_t *self, uint32_t ns, const pkey_t *k, size_t *position) {
    if (!self->table)
        return NONE;
    size_t i = key_hash(self, ns, k->data, k->len, k->hex) & self->table_mask;
    for (;; i = (i + 1) & self->table_mask) {
        uint32_t at = self->table[i];
        if (at == NONE)
            return NONE;
        if (page_matches(&self->pages[at], ns, k)) {
            if (position)
                *position = i;
            return at;
        }
    }
}

void table_place(index_t *self, uint32_t page) {
    size_t i = page_hash(self, &self->pages[page]) & self->table_mask;
    while (self->table[i] != NONE)
        i = (i + 1) & self->table_mask;
    self->table[i] = page;
}

int table_reserve(index_t *self, size_t count) {
    size_t capacity = self->table ? self->table_mask + 1 : 0;
    if (count * 10 <= capacity * 7)
        return 0;
    size_t grown = capacity ? capacity * 2 : 1024;
    while (count * 10 > grown * 7)
        grown *= 2;
    uint32_t *old = self->table;
    self->table = malloc(grown * sizeof *self->table);
    if (!self->table) {
        self->table = old;
        PyErr_NoMemory();
        return -1;
    }
    memset(self->table, 0xff, grown * sizeof *self->table);
    self->table_mask = grown - 1;
    if (old) {
        for (size_t i = 0; i < capacity; i++)
            if (old[i] != NONE)
                table_place(self, old[i]);
        free(old);
    }
    return 0;
}

/* Backward-shift deletion: no tombstones, probe runs stay as short as at insert. */
void table_delete(index_t *self, size_t i) {
    size_t mask = self->table_mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint32_t at = self->table[j];
        if (at == NONE)
            break;
        size_t home = page_hash(self, &self->pages[at]) & mask;
        /* move `at` back to i unless its home lies cyclically in (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            self->table[i] = at;
            i = j;
        }
    }
    self->table[i] = NONE;
    self->table_count--;
}

/* ---------------------------------------------------------------- proxies */

static inline size_t proxy_home(const index_t *self, uint32_t page) {
    return (size_t)(mix64(page) & self->proxy_mask);
}

PyObject *proxy_find(const index_t *self, uint32_t page) {
    if (!self->proxies)
        return NULL;
    for (size_t i = proxy_home(self, page);; i = (i + 1) & self->proxy_mask) {
        if (self->proxies[i].proxy == NULL)
            return NULL;
        if (self->proxies[i].page == page)
            return self->proxies[i].proxy;
    }
}

int proxy_put(index_t *self, uint32_t page, PyObject *proxy) {
    size_t capacity = self->proxies ? self->proxy_mask + 1 : 0;
    if ((self->proxy_count + 1) * 2 > capacity) {
        size_t grown = capacity ? capacity * 2 : 256;
        proxy_slot_t *old = self->proxies;
        self->proxies = calloc(grown, sizeof *self->proxies);
        if (!self->proxies) {
            self->proxies = old;
            PyErr_NoMemory();
            return -1;
        }
        self->proxy_mask = grown - 1;
        for (size_t i = 0; i < capacity; i++)
            if (old[i].proxy) {
                size_t j = proxy_home(self, old[i].page);
                while (self->proxies[j].proxy)
                    j = (j + 1) & self->proxy_mask;
                self->proxies[j] = old[i];
            }
        free(old);
    }
    size_t i = proxy_home(self, page);
    while (self->proxies[i].proxy)
        i = (i + 1) & self->proxy_mask;
    self->proxies[i].page = page;
    self->proxies[i].proxy = proxy;
    self->proxy_count++;
    return 0;
}

void proxy_drop(index_t *self, uint32_t page) {
    size_t mask = self->proxy_mask, i = proxy_home(self, page);
    while (self->proxies[i].page != page || !self->proxies[i].proxy)
        i = (i + 1) & mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!self->proxies[j].proxy)
            break;
        size_t home = proxy_home(self, self->proxies[j].page);
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            self->proxies[i] = self->proxies[j];
            i = j;
        }
    }
    self->proxies[i].proxy = NULL;
    self->proxy_count--;
}

