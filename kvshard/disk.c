/*
 * disk.c — the disk tier: one file per page, named by its hash, in the store's directory.
 *
 * A write goes to a temporary file in the same directory, is fsync'ed, and is renamed over the
 * final name, so a reader (or a store re-opened after SIGKILL) sees either the whole page or no
 * page. Every read re-checks the checksum and that the header names the page the index expects
 * (hash, tokens, format, shape): a page that fails is deleted and counted, never served. At open
 * the directory is re-indexed: temporaries are removed, every page file is verified, pages whose
 * chain parent is not on disk are dropped (they could never be reached), and the survivors
 * become disk-tier pages of the prefix index, so a restarted worker comes back warm (store.c
 * then trims them to the disk budget through evict.c).
 *
 * With a cluster secret (kv_config.disk_secret) every page file is sealed (diskfmt.c): its token
 * ids and KV encrypted and, with its header, authenticated, so another local account reads no
 * tenant's prompt from it, and a page whose seal is missing or wrong is dropped (deleted, counted
 * in unauthenticated_pages, logged as kv_disk_page_unauthenticated) at re-index and on every
 * read: the checksum alone stops torn pages, not someone with write access to the directory who
 * recomputes it. Pages of the format before sealing (a keyed MAC, token ids in clear) are sealed
 * again at re-index when their MAC verifies, and dropped like any other otherwise. Without a
 * secret a page's MAC, if it has one, is not checked (nothing to check it with), and a sealed
 * page cannot be read: it is left alone (skipped_files) for a store that has the secret. The
 * disk budget counts page files without the seal's 40 bytes, a rounding error next to a page.
 *
 * The directory is the worker's alone: created 0700 (and existing ones of the worker's narrowed
 * to it), files 0600, whatever the umask; one that group or others may write is refused at open,
 * since whoever can write there can plant or swap page files.
 *
 * This file is the page files and nothing else: it calls the index, page memory and accounting
 * below it; choosing what goes to disk and when is evict.c's (demotion) and tier.c's (persist).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "common/sec.h"
#include "kvshard/diskfmt.h"
#include "kvshard/internal.h"

int kv_disk_enabled(const kv_store *s)
{
    return s->disk_dir != NULL;
}

static void kv_disk_path(const kv_store *s, km_pagehash h, char *out, size_t cap)
{
    char hex[33];
    km_pagehash_hex(h, hex);
    snprintf(out, cap, "%s/%s.kvp", s->disk_dir, hex);
}

static int kv_write_all(int fd, const uint8_t *b, size_t n)
{
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return KM_EIO;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

static int kv_read_all(int fd, uint8_t *b, size_t n)
{
    while (n) {
        ssize_t r = read(fd, b, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return KM_EIO;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}

/* Writes d as the page file of its hash (sealed with a secret), atomically. */
static int kv_disk_put(kv_store *s, const kv_disk_page *d)
{
    size_t n = kv_disk_page_size(d->payload_bytes, d->page_tokens) +
               (s->disk_mac ? KV_DISK_SEAL_BYTES : 0);
    uint8_t *b = malloc(n);
    if (!b) return KM_ENOMEM;
    kv_disk_page plain = *d;
    plain.mac = plain.seal = NULL;
    if (s->disk_mac)
        kv_disk_page_encode_sealed(&plain, s->disk_seal_key, b, n);
    else
        kv_disk_page_encode(&plain, b, n);
    char path[PATH_MAX], tmp[PATH_MAX];
    kv_disk_path(s, d->hash, path, sizeof path);
    char hex[33];
    km_pagehash_hex(d->hash, hex);
    snprintf(tmp, sizeof tmp, "%s/.tmp-%s-%d-%llu", s->disk_dir, hex, (int)getpid(),
             (unsigned long long)++s->tmp_ctr);
    int rc = KM_EIO;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd >= 0) {
        rc = kv_write_all(fd, b, n);
        if (!rc && fchmod(fd, 0600)) rc = KM_EIO; /* the umask may have narrowed it */
        if (!rc && fsync(fd)) rc = KM_EIO;
        if (close(fd)) rc = KM_EIO;
        if (!rc && rename(tmp, path)) rc = KM_EIO;
        if (rc) unlink(tmp);
    }
    free(b);
    if (rc) {
        s->st.disk_write_errors++;
        KM_WARN("kv_disk_write_failed", "path=%s errno=%d", path, errno);
    }
    return rc;
}

int kv_disk_write(kv_store *s, kv_page *p)
{
    /* one file per indexed page, written from its RAM copy */
    assert(p->buf && p->tier != KV_TIER_DISK && (p->flags & KV_PAGE_INDEXED) &&
           !(p->flags & KV_PAGE_ON_DISK));
    const size_t pb = s->lay[p->format].page_bytes;
    kv_disk_page d = {
        .format = p->format,
        .page_tokens = s->pt,
        .n_layers = s->n_layers,
        .n_kv_heads = s->n_heads,
        .head_dim = s->hd,
        .hash = p->hash,
        .parent = p->parent,
        .index = p->index,
        .tokens = (const uint8_t *)p->tokens,
        .payload = p->buf,
        .payload_bytes = pb,
        .position_free = (p->flags & KV_PAGE_POSFREE) != 0,
    };
    int rc = kv_disk_put(s, &d);
    if (rc) return rc;
    p->flags |= KV_PAGE_ON_DISK;
    kv_disk_slice_sums(s, p, p->buf);
    kv_acct_add(s, p->shard, KV_TIER_DISK, p->format, 1);
    return 0;
}

/* Reads a whole page file of lo..hi bytes; *buf is the caller's to free. Only a regular file is
 * read, and only after its size is checked: the open neither follows a symlink nor waits (a FIFO
 * named like a page would otherwise block the worker's start forever), and a file of the wrong
 * size is never read (a sparse file of gigabytes would otherwise be read into memory).
 * KM_EUNSUPPORTED: not a regular file (*why says what it is); KM_ECORRUPT: the wrong size. */
static int kv_disk_load(const char *path, size_t lo, size_t hi, uint8_t **buf, size_t *len,
                        const char **why)
{
    *buf = NULL;
    *why = "size";
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (fd < 0) {
        *why = errno == ELOOP ? "symlink" : "open";
        return errno == ELOOP ? KM_EUNSUPPORTED : KM_EIO;
    }
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        close(fd);
        *why = "not_a_regular_file";
        return KM_EUNSUPPORTED;
    }
    if (st.st_size < 0 || (size_t)st.st_size < lo || (size_t)st.st_size > hi) {
        close(fd);
        return KM_ECORRUPT;
    }
    size_t n = (size_t)st.st_size;
    uint8_t *b = malloc(n ? n : 1);
    if (!b)
        rc = KM_ENOMEM;
    else if (kv_read_all(fd, b, n))
        rc = KM_ECORRUPT;
    close(fd);
    if (rc) {
        free(b);
        return rc;
    }
    *buf = b;
    *len = n;
    return 0;
}

static int kv_disk_matches(const kv_store *s, const kv_disk_page *d)
{
    return d->page_tokens == s->pt && d->n_layers == s->n_layers && d->n_kv_heads == s->n_heads &&
           d->head_dim == s->hd;
}

/* With a cluster secret, whether a parsed page may be served: 0 for a sealed page whose seal
 * verifies (its tokens and payload are then decrypted in b), or, where older is not NULL (at
 * re-index), for a page of the format before sealing whose MAC verifies (*older set: the caller
 * seals it again). Otherwise counts and logs it and returns KM_ECORRUPT (the caller drops it).
 * Without a secret: 0 (the caller keeps sealed pages away). */
static int kv_disk_authentic(kv_store *s, uint8_t *b, size_t n, const kv_disk_page *d,
                             const char *path, bool *older)
{
    if (!s->disk_mac) return 0;
    const char *why = d->mac ? "not_sealed" : "no_seal";
    if (d->seal) {
        if (!kv_disk_page_unseal(b, n, d, s->disk_seal_key)) return 0;
        why = "wrong_seal";
    } else if (d->mac && older) {
        if (!kv_disk_page_verify_mac(b, n, d, s->disk_mac_key)) return *older = true, 0;
        why = "wrong_mac";
    }
    s->st.unauthenticated_pages++;
    KM_WARN("kv_disk_page_unauthenticated", "path=%s reason=%s", path, why);
    return KM_ECORRUPT;
}

/* kv_disk_read's work without counting: *unauth says a failure was the seal's. */
static int kv_disk_read_quiet(const kv_store *s, const kv_page *p, uint8_t *dst, const char **why,
                              int *unauth)
{
    char path[PATH_MAX];
    kv_disk_path(s, p->hash, path, sizeof path);
    uint8_t *b;
    size_t n;
    /* without a secret a page may or may not carry a MAC: the parser checks the exact size */
    size_t size = kv_disk_page_size(s->lay[p->format].page_bytes, s->pt);
    *unauth = 0;
    int rc =
        kv_disk_load(path, s->disk_mac ? size + KV_DISK_SEAL_BYTES : size,
                     size + (s->disk_mac ? KV_DISK_SEAL_BYTES : KV_DISK_MAC_BYTES), &b, &n, why);
    kv_disk_page d = {0};
    if (!rc) rc = kv_disk_page_parse(b, n, &d);
    if (!rc && (!kv_disk_matches(s, &d) || d.format != p->format ||
                !km_pagehash_eq(d.hash, p->hash) || (d.seal && !s->disk_mac)))
        rc = KM_ECORRUPT;
    if (!rc && s->disk_mac) {
        *why = d.mac ? "not_sealed" : "no_seal";
        if (!d.seal || kv_disk_page_unseal(b, n, &d, s->disk_seal_key)) {
            if (d.seal) *why = "wrong_seal";
            *unauth = 1;
            rc = KM_ECORRUPT;
        }
    }
    /* token ids compared once they are plaintext */
    if (!rc && memcmp(d.tokens, p->tokens, (size_t)s->pt * 4)) rc = KM_ECORRUPT;
    if (!rc) memcpy(dst, d.payload, d.payload_bytes);
    free(b);
    if (!rc || rc == KM_ENOMEM) return rc;
    if (rc != KM_EUNSUPPORTED && !*unauth) *why = km_strerror(rc);
    return KM_ECORRUPT;
}

void kv_disk_slice_sums(kv_store *s, kv_page *p, const uint8_t *payload)
{
    p->flags &= ~KV_PAGE_SLICES;
    if (s->disk_mac) return; /* sealed: a layer's bytes on disk are ciphertext under one tag */
    if (!p->slice_sum && !(p->slice_sum = malloc(sizeof(uint64_t) * (size_t)s->n_layers))) return;
    const size_t per = kv_layer_bytes(s, p->format);
    for (int l = 0; l < s->n_layers; l++)
        p->slice_sum[l] = XXH3_64bits_withSeed(payload + per * l, per, (uint64_t)l);
    p->flags |= KV_PAGE_SLICES;
}

/* Layer `layer` of p's page file into dst: one read at its offset, verified against the
 * checksum kept when the file was written (the rest of the file is not read, so not checked). */
static int kv_disk_read_slice(const kv_store *s, const kv_page *p, int layer, uint8_t *dst)
{
    /* the promoter's: p->flags is the owner's to change, checked when the read was asked for */
    if (!p->slice_sum || layer < 0 || layer >= s->n_layers) return KM_EINVAL;
    char path[PATH_MAX];
    kv_disk_path(s, p->hash, path, sizeof path);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (fd < 0) return KM_ECORRUPT;
    const size_t per = kv_layer_bytes(s, p->format);
    const off_t at = (off_t)(kv_disk_page_payload_offset(s->pt) + per * (size_t)layer);
    struct stat st;
    int rc = fstat(fd, &st) || !S_ISREG(st.st_mode) ||
                     (size_t)st.st_size != kv_disk_page_size(s->lay[p->format].page_bytes, s->pt)
                 ? KM_ECORRUPT
                 : 0;
    for (size_t got = 0; !rc && got < per;) {
        ssize_t r = pread(fd, dst + got, per - got, at + (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) rc = KM_ECORRUPT;
        got += r > 0 ? (size_t)r : 0;
    }
    close(fd);
    if (!rc && XXH3_64bits_withSeed(dst, per, (uint64_t)layer) != p->slice_sum[layer])
        rc = KM_ECORRUPT;
    return rc;
}

int kv_disk_fetch(const kv_store *s, const kv_page *p, int layer, uint8_t *dst)
{
    if (layer >= 0) return kv_disk_read_slice(s, p, layer, dst);
    const char *why;
    int unauth;
    return kv_disk_read_quiet(s, p, dst, &why, &unauth);
}

int kv_disk_read(kv_store *s, kv_page *p, uint8_t *dst)
{
    const char *why = "size";
    int unauth;
    int rc = kv_disk_read_quiet(s, p, dst, &why, &unauth);
    if (rc == KM_ECORRUPT) {
        char path[PATH_MAX];
        kv_disk_path(s, p->hash, path, sizeof path);
        if (unauth) {
            s->st.unauthenticated_pages++;
            KM_WARN("kv_disk_page_unauthenticated", "path=%s reason=%s", path, why);
        } else {
            s->st.corrupt_pages++;
            KM_WARN("kv_disk_page_rejected", "path=%s err=%s", path, why);
        }
    }
    return rc;
}

/* The largest page file this store could have written (any of its formats, sealed). */
static size_t kv_disk_max_file(const kv_store *s)
{
    size_t max = 0;
    for (int f = 0; f < KV_FORMAT_COUNT; f++) {
        if (!s->lay[f].unit) continue;
        size_t n = kv_disk_page_size(s->lay[f].page_bytes, s->pt) + KV_DISK_SEAL_BYTES;
        if (n > max) max = n;
    }
    return max;
}

void kv_disk_unlink(kv_store *s, kv_page *p)
{
    assert(p->flags & KV_PAGE_ON_DISK);
    char path[PATH_MAX];
    kv_disk_path(s, p->hash, path, sizeof path);
    unlink(path);
    kv_acct_sub(s, p->shard, KV_TIER_DISK, p->format);
    p->flags &= ~(KV_PAGE_ON_DISK | KV_PAGE_SLICES);
}

static int kv_by_index(const void *a, const void *b)
{
    const kv_page *x = *(kv_page *const *)a, *y = *(kv_page *const *)b;
    return (x->index > y->index) - (x->index < y->index);
}

/* The directory, the worker's alone: created 0700; an existing one others may write is refused,
 * one of the worker's that others may read or enter is narrowed to 0700. */
static int kv_disk_dir_prepare(const char *d, km_errbuf *err)
{
    if (mkdir(d, 0700) == 0) {
        if (chmod(d, 0700)) /* the umask may have narrowed it */
            return km_errf(err, KM_EIO, "kv disk tier: cannot chmod %s: %s", d, strerror(errno));
        return 0;
    }
    if (errno != EEXIST)
        return km_errf(err, KM_EIO, "kv disk tier: cannot create %s: %s", d, strerror(errno));
    struct stat st;
    if (stat(d, &st) || !S_ISDIR(st.st_mode))
        return km_errf(err, KM_EIO, "kv disk tier: %s is not a directory", d);
    unsigned mode = (unsigned)st.st_mode & 07777;
    if (mode & 022)
        return km_errf(err, KM_EINVAL,
                       "kv disk tier: %s has mode %04o: group or others may write there, plant or "
                       "swap page files; use a directory of the worker's own (chmod 700 %s)",
                       d, mode, d);
    if (!(mode & 077)) return 0;
    if (st.st_uid == geteuid() && !chmod(d, 0700))
        KM_INFO("kv_disk_dir_narrowed", "dir=%s mode=%04o now=0700", d, mode);
    else
        KM_WARN("kv_disk_dir_readable", "dir=%s mode=%04o: others may read page files", d, mode);
    return 0;
}

int kv_disk_open(kv_store *s, km_errbuf *err)
{
    if (s->cfg.disk_secret) { /* keys for these purposes only, derived once: the secret is not
                                 read again */
        km_secret_derive(s->cfg.disk_secret, "kvmpage1", 1, s->disk_mac_key);
        km_secret_derive(s->cfg.disk_secret, "kvmseal1", 1, s->disk_seal_key);
        s->disk_mac = 1;
        s->cfg.disk_secret = NULL;
    }
    int drc = kv_disk_dir_prepare(s->disk_dir, err);
    if (drc) return drc;
    DIR *dir = opendir(s->disk_dir);
    if (!dir)
        return km_errf(err, KM_EIO, "kv disk tier: cannot open %s: %s", s->disk_dir,
                       strerror(errno));
    kv_page **found = NULL;
    size_t n_found = 0, cap = 0, max_file = kv_disk_max_file(s);
    struct dirent *de;
    char path[PATH_MAX];
    while ((de = readdir(dir))) {
        const char *name = de->d_name;
        size_t len = strlen(name);
        snprintf(path, sizeof path, "%s/%s", s->disk_dir, name);
        if (!strncmp(name, ".tmp-", 5)) { /* a write that never reached its rename */
            unlink(path);
            continue;
        }
        if (len != 36 || strcmp(name + 32, ".kvp")) continue;
        uint8_t *b;
        size_t n;
        kv_disk_page d = {0};
        const char *why;
        int rc = kv_disk_load(path, 0, max_file, &b, &n, &why);
        if (rc == KM_EUNSUPPORTED || (rc == KM_ECORRUPT && !strcmp(why, "size"))) {
            /* not a file this store wrote (a FIFO, a symlink, something larger than any of its
             * pages): left alone, never read, and said so */
            s->st.skipped_files++;
            KM_WARN("kv_disk_file_skipped", "path=%s reason=%s", path,
                    rc == KM_EUNSUPPORTED ? why : "larger_than_any_page");
            continue;
        }
        if (rc == KM_ENOMEM) {
            closedir(dir);
            free(found);
            return km_errf(err, rc, "kv disk tier: out of memory");
        }
        if (!rc) rc = kv_disk_page_parse(b, n, &d);
        if (!rc && !kv_disk_matches(s, &d)) { /* another model's page: not ours to judge */
            free(b);
            continue;
        }
        if (!rc && d.seal && !s->disk_mac) { /* unreadable without the secret, kept for it */
            s->st.skipped_files++;
            KM_WARN("kv_disk_file_skipped", "path=%s reason=sealed_without_secret", path);
            free(b);
            continue;
        }
        char hex[33];
        if (!rc) {
            km_pagehash_hex(d.hash, hex);
            if (strncmp(name, hex, 32) || kv_index_find(s, d.hash) || !s->lay[d.format].unit)
                rc = KM_ECORRUPT;
        }
        bool older = false;
        if (!rc && kv_disk_authentic(s, b, n, &d, path, &older)) { /* counted there */
            free(b);
            unlink(path);
            continue;
        }
        if (!rc && older && kv_disk_put(s, &d)) { /* sealed again, or gone */
            free(b);
            unlink(path);
            continue;
        }
        kv_page *p = NULL;
        if (!rc && n_found == cap) {
            cap = cap ? cap * 2 : 64;
            kv_page **nf = realloc(found, sizeof *nf * cap);
            if (!nf)
                rc = KM_ENOMEM;
            else
                found = nf;
        }
        if (!rc && !(p = kv_page_new(s))) rc = KM_ENOMEM;
        if (!rc && !(p->tokens = malloc((size_t)s->pt * 4))) rc = KM_ENOMEM;
        if (rc) {
            free(b);
            if (p) free(p);
            if (rc == KM_ENOMEM) {
                closedir(dir);
                for (size_t i = 0; i < n_found; i++) { /* forget them; the files stay */
                    kv_index_remove(s, found[i]);
                    free(found[i]->tokens);
                    free(found[i]->slice_sum);
                    free(found[i]);
                }
                free(found);
                return km_errf(err, rc, "kv disk tier: out of memory");
            }
            s->st.corrupt_pages++;
            KM_WARN("kv_disk_page_rejected", "path=%s err=%s", path, km_strerror(rc));
            unlink(path);
            continue;
        }
        memcpy(p->tokens, d.tokens, (size_t)s->pt * 4);
        p->hash = d.hash;
        p->parent = d.parent;
        p->index = d.index;
        p->format = d.format;
        p->tier = KV_TIER_DISK;
        p->flags = KV_PAGE_ON_DISK | (d.position_free ? KV_PAGE_POSFREE : 0);
        p->shard = (int)(d.hash.lo % (uint64_t)s->n_shards);
        atomic_store_explicit(&p->rows, s->rows_full, memory_order_relaxed);
        if (!d.seal && !older) kv_disk_slice_sums(s, p, d.payload);
        free(b);
        kv_index_insert(s, p);
        kv_acct_add(s, p->shard, KV_TIER_DISK, p->format, 1);
        found[n_found++] = p;
    }
    closedir(dir);
    /* Parents before children: a page is kept only when its parent was kept. */
    if (n_found) qsort(found, n_found, sizeof *found, kv_by_index);
    size_t kept = 0;
    for (size_t i = 0; i < n_found; i++) {
        kv_page *p = found[i], *par = p->index ? kv_index_find(s, p->parent) : NULL;
        if (p->index && (!par || par->index != p->index - 1)) {
            kv_index_remove(s, p); /* never announced, so no REMOVED event */
            kv_disk_unlink(s, p);  /* the unreachable file */
            kv_page_release(s, p);
            continue;
        }
        p->parent_id = par ? par->id : 0;
        p->last_use = ++s->clock;
        kv_list_push(s, p);
        kv_event_emit(s, KV_EVENT_STORED, p, KV_TIER_DISK, KV_TIER_DISK);
        kept++;
    }
    free(found);
    KM_INFO("kv_disk_reindexed", "dir=%s pages=%zu dropped=%zu", s->disk_dir, kept, n_found - kept);
    return 0;
}
