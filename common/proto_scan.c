/*
 * proto_scan.c — the bounds scan every frame passes before msgpack-c sees it
 * (km_proto_scan, proto_internal.h).
 *
 * Why it exists: msgpack-c allocates an array's elements (and a map's pairs) as soon as it reads
 * the count, so a 5-byte frame claiming 2^32 elements would ask for 100 GB. The scan walks the
 * raw bytes first, allocating nothing: every length and element count must fit in what is left
 * of the frame, depth is capped, trailing bytes are an error. After it, the tree msgpack-c builds
 * is at most a small multiple of the frame. The scan is also where a rejected frame's id is
 * found, so attributing an error never needs a second, unguarded parse.
 */
#include <string.h>

#include "common/proto_internal.h"

#define SCAN_MAX_DEPTH 8
#define SCAN_MAX_MAP   64 /* entries of any map; no kvmesh map has more than ~30 keys */

static uint64_t be_load(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = v << 8 | p[i];
    return v;
}

/* What one msgpack type byte announces. */
typedef struct mp_kind {
    uint8_t hdr;   /* bytes of length or count that follow the type byte */
    uint8_t fixed; /* payload bytes beyond that length (ext type byte, int and float widths) */
    bool container, map, str, uint, valid;
} mp_kind;

/* The one-byte types with a length or count in the byte itself are handled by the caller; the
 * rest is this table (msgpack spec, "formats"). 0xc1 is never used and stays invalid. */
static mp_kind mp_kind_of(uint8_t b)
{
    switch (b) {
    case 0xc0: /* nil */
    case 0xc2: /* false */
    case 0xc3: /* true */
        return (mp_kind){.valid = true};
    case 0xc4:
        return (mp_kind){.hdr = 1, .valid = true}; /* bin8 */
    case 0xc5:
        return (mp_kind){.hdr = 2, .valid = true}; /* bin16 */
    case 0xc6:
        return (mp_kind){.hdr = 4, .valid = true}; /* bin32 */
    case 0xc7:
        return (mp_kind){.hdr = 1, .fixed = 1, .valid = true}; /* ext8: len, type */
    case 0xc8:
        return (mp_kind){.hdr = 2, .fixed = 1, .valid = true}; /* ext16 */
    case 0xc9:
        return (mp_kind){.hdr = 4, .fixed = 1, .valid = true}; /* ext32 */
    case 0xca:
        return (mp_kind){.fixed = 4, .valid = true}; /* float32 */
    case 0xcb:
        return (mp_kind){.fixed = 8, .valid = true}; /* float64 */
    case 0xcc:
        return (mp_kind){.fixed = 1, .uint = true, .valid = true};
    case 0xcd:
        return (mp_kind){.fixed = 2, .uint = true, .valid = true};
    case 0xce:
        return (mp_kind){.fixed = 4, .uint = true, .valid = true};
    case 0xcf:
        return (mp_kind){.fixed = 8, .uint = true, .valid = true};
    case 0xd0:
        return (mp_kind){.fixed = 1, .valid = true}; /* int8 .. int64 */
    case 0xd1:
        return (mp_kind){.fixed = 2, .valid = true};
    case 0xd2:
        return (mp_kind){.fixed = 4, .valid = true};
    case 0xd3:
        return (mp_kind){.fixed = 8, .valid = true};
    case 0xd4:
        return (mp_kind){.fixed = 2, .valid = true}; /* fixext 1..16: type + data */
    case 0xd5:
        return (mp_kind){.fixed = 3, .valid = true};
    case 0xd6:
        return (mp_kind){.fixed = 5, .valid = true};
    case 0xd7:
        return (mp_kind){.fixed = 9, .valid = true};
    case 0xd8:
        return (mp_kind){.fixed = 17, .valid = true};
    case 0xd9:
        return (mp_kind){.hdr = 1, .str = true, .valid = true}; /* str8 */
    case 0xda:
        return (mp_kind){.hdr = 2, .str = true, .valid = true}; /* str16 */
    case 0xdb:
        return (mp_kind){.hdr = 4, .str = true, .valid = true}; /* str32 */
    case 0xdc:
        return (mp_kind){.hdr = 2, .container = true, .valid = true}; /* array16 */
    case 0xdd:
        return (mp_kind){.hdr = 4, .container = true, .valid = true}; /* array32 */
    case 0xde:
        return (mp_kind){.hdr = 2, .container = true, .map = true, .valid = true};
    case 0xdf:
        return (mp_kind){.hdr = 4, .container = true, .map = true, .valid = true};
    }
    return (mp_kind){.valid = false};
}

/* Following the root map's keys and values for its first "id". */
typedef struct id_watch {
    bool root_map;   /* the frame is a map: its items are at depth 1 */
    uint64_t items;  /* root items read so far: keys even, values odd */
    bool next_is_id; /* the key just read was "id" */
    bool found;
} id_watch;

/* One scalar item at depth `depth` with payload p[0..n) (the value bytes of an int, the bytes of
 * a string). */
static void id_watch_item(id_watch *w, int depth, uint8_t type, const mp_kind *k, const uint8_t *p,
                          uint64_t n, uint64_t *id)
{
    if (depth != 1 || !w->root_map) return;
    bool key = w->items++ % 2 == 0;
    if (key) {
        w->next_is_id = !w->found && k->str && n == 2 && !memcmp(p, "id", 2);
    } else if (w->next_is_id) {
        w->next_is_id = false;
        if (type <= 0x7f) {
            *id = type;
            w->found = true;
        } else if (k->uint) {
            *id = be_load(p, (int)n);
            w->found = true;
        }
    }
}

int km_proto_scan(const uint8_t *p, size_t len, uint64_t max_array, uint64_t *id, km_errbuf *err)
{
    uint64_t left[SCAN_MAX_DEPTH + 1]; /* items still to read in each open container */
    int depth = 0;
    size_t pos = 0;
    left[0] = 1;
    id_watch w = {0};
    while (depth >= 0) {
        if (left[depth] == 0) {
            depth--;
            continue;
        }
        left[depth]--;
        if (pos >= len) return km_errf(err, KM_EFORMAT, "truncated frame at byte %zu", pos);
        uint8_t b = p[pos++];
        size_t rest = len - pos;
        uint64_t count = 0; /* container items (pairs for a map) */
        uint64_t skip = 0;  /* payload bytes of a scalar */
        mp_kind k;
        if (b <= 0x7f || b >= 0xe0) { /* positive and negative fixint */
            k = (mp_kind){.valid = true};
        } else if (b <= 0x9f) { /* fixmap, fixarray */
            k = (mp_kind){.container = true, .map = b <= 0x8f, .valid = true};
            count = b & 0x0f;
        } else if (b <= 0xbf) { /* fixstr */
            k = (mp_kind){.str = true, .valid = true};
            skip = b & 0x1f;
        } else {
            k = mp_kind_of(b);
            if (!k.valid)
                return km_errf(err, KM_EFORMAT, "invalid msgpack type byte 0x%02x at byte %zu", b,
                               pos - 1);
            if (rest < k.hdr) return km_errf(err, KM_EFORMAT, "truncated frame at byte %zu", pos);
            uint64_t n = k.hdr ? be_load(p + pos, k.hdr) : 0;
            pos += k.hdr;
            rest -= k.hdr;
            if (k.container)
                count = n;
            else
                skip = n + k.fixed;
        }
        if (depth == 0 && k.map) w.root_map = true;
        if (!k.container) {
            if (skip > rest)
                return km_errf(err, KM_EFORMAT,
                               "truncated frame: value at byte %zu needs %llu bytes, %zu left", pos,
                               (unsigned long long)skip, rest);
            id_watch_item(&w, depth, b, &k, p + pos, skip, id);
            pos += (size_t)skip;
            continue;
        }
        if (depth == 1 && w.root_map) w.items++, w.next_is_id = false; /* a container item */
        if (k.map && count > SCAN_MAX_MAP)
            return km_errf(err, KM_EFORMAT, "map of %llu entries at byte %zu, limit %d",
                           (unsigned long long)count, pos, SCAN_MAX_MAP);
        if (!k.map && count > max_array)
            return km_errf(err, KM_ERANGE, "array of %llu elements at byte %zu, limit %llu",
                           (unsigned long long)count, pos, (unsigned long long)max_array);
        uint64_t items = k.map ? 2 * count : count;
        if (items > rest)
            return km_errf(err, KM_EFORMAT,
                           "truncated frame: container at byte %zu claims %llu items in %zu bytes",
                           pos, (unsigned long long)items, rest);
        if (items) {
            if (depth == SCAN_MAX_DEPTH)
                return km_errf(err, KM_EFORMAT, "nesting deeper than %d at byte %zu",
                               SCAN_MAX_DEPTH, pos);
            left[++depth] = items;
        }
    }
    if (pos != len)
        return km_errf(err, KM_EFORMAT, "%zu trailing bytes after the frame", len - pos);
    return 0;
}
