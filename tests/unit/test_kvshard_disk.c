/*
 * test_kvshard_disk.c — the disk tier: pages survive a restart and are reused; a corrupt or
 * torn page is dropped and never served; leftovers of interrupted writes are cleaned; and a
 * crash test that SIGKILLs a writer many times and then proves every page a fresh store serves
 * is exactly the one that was written. With a cluster secret, pages carry a keyed MAC: a page
 * whose KV was altered and whose checksum was recomputed (what anyone with write access to the
 * directory can do) is served without a secret and refused with one, as is a page without a
 * MAC or with another cluster's. With a secret, pages are sealed (token ids and KV encrypted):
 * the files hold neither in clear, any flipped byte drops the page, and pages of the format
 * before sealing are sealed again at open. The directory is 0700 and the files 0600 whatever the
 * umask, and a directory others may write is refused. With kv_config.promote_selected an attached
 * prefix stays on disk, and kv_seq_fetch brings up only the pages asked for, read on the
 * promoter thread; one that fails verification there reads as zeros and is never served again.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "common/sec.h"
#include "kvshard/diskfmt.h"
#include "kvshard/internal.h" /* kv_store_check */
#include "kvshard/kvshard.h"

#define L  2
#define H  2
#define HD 16
#define PT 4

static float kval(int tok, int l, int h, int c)
{
    return (float)((tok * 7 + l * 3 + h * 5 + c) % 32 - 16) / 8.0f;
}

static kv_store *open_store_secret(const char *dir, size_t hot_pages, const uint8_t *secret)
{
    kv_config c = {.n_layers = L,
                   .n_kv_heads = H,
                   .head_dim = HD,
                   .page_tokens = PT,
                   .disk_dir = dir,
                   .disk_secret = secret,
                   .sync_promote = 1};
    c.hot_bytes = hot_pages * (size_t)PT * HD * 2 * 2 * L * H;
    kv_store *s;
    km_errbuf err;
    int rc = kv_store_create(&c, &s, &err);
    cr_assert_eq(rc, 0, "%s", err.msg);
    return s;
}

static kv_store *open_store(const char *dir, size_t hot_pages)
{
    return open_store_secret(dir, hot_pages, NULL);
}

static void tokens_of(int seed, int32_t *t, int n)
{
    for (int i = 0; i < n; i++) t[i] = seed * 100 + i;
}

static void chain(const int32_t *t, int n, km_pagehash *h)
{
    km_pagehash seed = km_pagehash_seed("m", 1, 9, NULL, 0);
    km_pagehash_chain(seed, t, n, PT, h, n / PT);
}

/* Writes, publishes and releases a 2-page sequence, then pushes it to disk. */
static void persist(kv_store *s, int seed)
{
    int32_t t[2 * PT];
    km_pagehash h[2];
    tokens_of(seed, t, 2 * PT);
    chain(t, 2 * PT, h);
    kv_seq *q;
    kv_seq_create(s, &q);
    cr_assert_eq(kv_seq_reserve(s, q, 2 * PT), 0);
    float k[H * HD];
    for (int p = 0; p < 2 * PT; p++)
        for (int l = 0; l < L; l++) {
            for (int i = 0; i < H * HD; i++) k[i] = kval(t[p], l, i / HD, i % HD);
            kv_seq_write(s, q, l, p, k, k);
        }
    kv_seq_publish(s, q, h, t, 2 * PT);
    kv_seq_destroy(s, q);
    kv_store_evict_oldest_fraction(s, 1.0);
}

/* Pages of `seed` a store serves (0..2), with in *wrong how many K/V values differ from what
 * was written. */
static int served_values(kv_store *s, int seed, int *wrong)
{
    int32_t t[2 * PT];
    km_pagehash h[2];
    tokens_of(seed, t, 2 * PT);
    chain(t, 2 * PT, h);
    kv_seq *q;
    kv_seq_create(s, &q);
    int n = kv_seq_attach(s, q, h, t, 2);
    cr_assert_geq(n, 0);
    float k[HD], v[HD];
    for (int p = 0; p < n * PT; p++)
        for (int l = 0; l < L; l++)
            for (int hh = 0; hh < H; hh++) {
                cr_assert_eq(kv_seq_read(s, q, l, hh, p, k, v), 0);
                for (int c = 0; c < HD; c++)
                    *wrong += (k[c] != kval(t[p], l, hh, c)) + (v[c] != kval(t[p], l, hh, c));
            }
    kv_seq_destroy(s, q);
    return n;
}

/* Pages of `seed` a store serves (0..2); fails the test on any wrong value. */
static int served(kv_store *s, int seed)
{
    int wrong = 0, n = served_values(s, seed, &wrong);
    cr_assert_eq(wrong, 0, "seed %d: %d wrong K/V values served", seed, wrong);
    return n;
}

static char *mk_dir(void)
{
    char *d = strdup("/tmp/kvshard-test-XXXXXX");
    cr_assert_not_null(mkdtemp(d));
    return d;
}

static void rm_dir(char *d)
{
    DIR *dir = opendir(d);
    struct dirent *de;
    char p[512];
    while (dir && (de = readdir(dir))) {
        if (de->d_name[0] == '.' && (!de->d_name[1] || de->d_name[1] == '.')) continue;
        snprintf(p, sizeof p, "%s/%s", d, de->d_name);
        unlink(p);
    }
    if (dir) closedir(dir);
    rmdir(d);
    free(d);
}

static int count_files(const char *d, const char *suffix)
{
    DIR *dir = opendir(d);
    struct dirent *de;
    int n = 0;
    while ((de = readdir(dir))) {
        size_t l = strlen(de->d_name), sl = strlen(suffix);
        if (l >= sl && !strcmp(de->d_name + l - sl, suffix)) n++;
    }
    closedir(dir);
    return n;
}

/* Flips one byte of a file, off_from_end bytes before its end. */
static void flip_byte(const char *p, long off_from_end)
{
    int fd = open(p, O_RDWR);
    cr_assert_geq(fd, 0);
    off_t end = lseek(fd, 0, SEEK_END);
    unsigned char b;
    cr_assert_eq(pread(fd, &b, 1, end - off_from_end), 1);
    b ^= 0x40;
    cr_assert_eq(pwrite(fd, &b, 1, end - off_from_end), 1);
    close(fd);
}

/* Flips one byte of the first page file found. */
static void corrupt_one(const char *d, long off_from_end)
{
    DIR *dir = opendir(d);
    struct dirent *de;
    char p[512] = "";
    while ((de = readdir(dir)))
        if (strstr(de->d_name, ".kvp")) {
            snprintf(p, sizeof p, "%s/%s", d, de->d_name);
            break;
        }
    closedir(dir);
    flip_byte(p, off_from_end);
}

Test(kvshard_disk, pages_survive_a_restart_and_are_reused)
{
    char *d = mk_dir();
    kv_store *s = open_store(d, 4);
    for (int i = 0; i < 5; i++) persist(s, i);
    cr_assert_eq(count_files(d, ".kvp"), 10);
    kv_store_destroy(s);
    s = open_store(d, 4);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.pages_indexed, 10);
    kv_event ev[32];
    cr_assert_eq(kv_store_events_drain(s, ev, 32), 10, "re-indexed pages are announced");
    cr_assert_eq(ev[0].tier, KV_TIER_DISK);
    int32_t t[2 * PT];
    km_pagehash h[2];
    tokens_of(3, t, 2 * PT);
    chain(t, 2 * PT, h);
    kv_tier tiers[2];
    cr_assert_eq(kv_store_lookup(s, h, t, 2, tiers), 2);
    cr_assert_eq(tiers[0], KV_TIER_DISK);
    for (int i = 0; i < 5; i++) cr_assert_eq(served(s, i), 2);
    kv_store_destroy(s);
    rm_dir(d);
}

/* A chunk's pages (kvshard's position-free flag, docs/blend.md) keep the flag in their page
 * files: a store reopened over the directory counts them again and says so in their events. */
Test(kvshard_disk, position_free_pages_keep_their_flag_across_a_restart)
{
    char *d = mk_dir();
    kv_store *s = open_store(d, 4);
    int32_t t[2 * PT];
    km_pagehash h[2];
    tokens_of(40, t, 2 * PT);
    chain(t, 2 * PT, h);
    kv_seq *q;
    kv_seq_create(s, &q);
    kv_seq_set_position_free(q, 1);
    cr_assert_eq(kv_seq_reserve(s, q, 2 * PT), 0);
    float k[H * HD];
    for (int p = 0; p < 2 * PT; p++)
        for (int l = 0; l < L; l++) {
            for (int i = 0; i < H * HD; i++) k[i] = kval(t[p], l, i / HD, i % HD);
            kv_seq_write(s, q, l, p, k, k);
        }
    cr_assert_eq(kv_seq_publish(s, q, h, t, 2 * PT), 2);
    kv_seq_destroy(s, q);
    kv_store_evict_oldest_fraction(s, 1.0);
    persist(s, 41); /* and a plain chain beside it */
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.position_free_pages[KV_TIER_DISK], 2);
    kv_store_destroy(s);
    s = open_store(d, 4);
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.pages_indexed, 4);
    cr_assert_eq(st.position_free_pages[KV_TIER_DISK], 2, "the flag came back from the files");
    kv_event ev[8];
    int n = kv_store_events_drain(s, ev, 8), flagged = 0;
    for (int i = 0; i < n; i++) flagged += ev[i].position_free;
    cr_assert_eq(flagged, 2);
    cr_assert_eq(served(s, 41), 2);
    km_errbuf err;
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    kv_store_destroy(s);
    rm_dir(d);
}

/* Writes, publishes and releases a 2-page sequence, leaving it cached in RAM. */
static void cache_in_ram(kv_store *s, int seed)
{
    int32_t t[2 * PT];
    km_pagehash h[2];
    tokens_of(seed, t, 2 * PT);
    chain(t, 2 * PT, h);
    kv_seq *q;
    kv_seq_create(s, &q);
    cr_assert_eq(kv_seq_reserve(s, q, 2 * PT), 0);
    float k[H * HD];
    for (int p = 0; p < 2 * PT; p++)
        for (int l = 0; l < L; l++) {
            for (int i = 0; i < H * HD; i++) k[i] = kval(t[p], l, i / HD, i % HD);
            kv_seq_write(s, q, l, p, k, k);
        }
    kv_seq_publish(s, q, h, t, 2 * PT);
    kv_seq_destroy(s, q);
}

Test(kvshard_disk, persist_writes_hot_and_host_pages_so_a_new_store_is_warm)
{
    char *d = mk_dir();
    kv_config c = {.n_layers = L,
                   .n_kv_heads = H,
                   .head_dim = HD,
                   .page_tokens = PT,
                   .disk_dir = d,
                   .sync_promote = 1};
    c.hot_bytes = 8 * (size_t)PT * HD * 2 * 2 * L * H;
    c.host_bytes = c.hot_bytes;
    kv_store *s;
    km_errbuf err;
    cr_assert_eq(kv_store_create(&c, &s, &err), 0, "%s", err.msg);
    cache_in_ram(s, 1);
    cache_in_ram(s, 2);
    cr_assert_eq(kv_store_evict_oldest_fraction(s, 0.5), 2); /* seed 1 goes to the host tier */
    cache_in_ram(s, 3);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.tier[KV_TIER_HOST].pages, 2);
    cr_assert_eq(st.tier[KV_TIER_HOT].pages, 4);
    cr_assert_eq(count_files(d, ".kvp"), 0, "nothing reached the disk tier yet");
    cr_assert_eq(kv_store_persist(s, 0), 6);
    cr_assert_eq(count_files(d, ".kvp"), 6);
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pages, 4, "pages stay where they were");
    cr_assert_eq(kv_store_persist(s, 0), 0, "and are written once");
    for (int i = 1; i <= 3; i++) cr_assert_eq(served(s, i), 2);
    kv_store_destroy(s);
    s = open_store(d, 4);
    for (int i = 1; i <= 3; i++) cr_assert_eq(served(s, i), 2, "seed %d came back from disk", i);
    kv_store_destroy(s);
    rm_dir(d);
}

Test(kvshard_disk, persist_stays_within_the_disk_budget_and_keeps_chains_whole)
{
    char *d = mk_dir();
    const size_t page = (size_t)PT * HD * 2 * 2 * L * H;
    kv_config c = {.n_layers = L,
                   .n_kv_heads = H,
                   .head_dim = HD,
                   .page_tokens = PT,
                   .disk_dir = d,
                   .hot_bytes = 8 * page,
                   .disk_bytes = 3 * kv_disk_page_size(page, PT),
                   .sync_promote = 1};
    kv_store *s;
    km_errbuf err;
    cr_assert_eq(kv_store_create(&c, &s, &err), 0, "%s", err.msg);
    for (int i = 1; i <= 3; i++) cache_in_ram(s, i);
    int n = kv_store_persist(s, 0);
    cr_assert_eq(n, 3, "three page files fit");
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_leq(st.tier[KV_TIER_DISK].bytes, st.tier[KV_TIER_DISK].budget);
    kv_store_destroy(s);
    s = open_store(d, 4);
    kv_store_stats_get(s, &st);
    int served_pages = 0;
    for (int i = 1; i <= 3; i++) served_pages += served(s, i);
    cr_assert_eq(served_pages, 3, "the first pages of every chain first, no orphan child");
    cr_assert_eq(st.pages_indexed, 3);
    kv_store_destroy(s);
    rm_dir(d);
}

Test(kvshard_disk, a_corrupt_page_is_dropped_at_open_and_never_served)
{
    char *d = mk_dir();
    kv_store *s = open_store(d, 4);
    persist(s, 1);
    kv_store_destroy(s);
    corrupt_one(d, 20); /* inside the payload */
    s = open_store(d, 4);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.corrupt_pages, 1);
    cr_assert_leq(served(s, 1), 1);
    kv_store_destroy(s);
    rm_dir(d);
}

/* A store on d opened again after it pushed seed's 2-page chain to disk. */
static kv_store *reopened_after_persist(const char *d, int seed)
{
    kv_store *s = open_store(d, 4);
    persist(s, seed);
    kv_store_destroy(s);
    return open_store(d, 4);
}

Test(kvshard_disk, a_page_corrupted_after_open_is_rejected_on_read)
{
    char *d = mk_dir();
    kv_store *s = reopened_after_persist(d, 1);
    corrupt_one(d, 4); /* the checksum itself */
    corrupt_one(d, 4 + 8 + 200);
    int n = served(s, 1);
    cr_assert_lt(n, 2);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_geq(st.corrupt_pages, 1);
    cr_assert_eq(served(s, 1), n, "and it stays gone");
    kv_store_destroy(s);
    rm_dir(d);
}

/* A chain's first page fails its checksum on a read: the rest of the chain, which no lookup
 * could reach any more, goes with it, so the recomputed prompt is indexed whole again (the
 * regression kept page 1 indexed and stopped the recompute's publishing at it for good). */
Test(kvshard_disk, a_corrupt_page_takes_the_rest_of_its_chain_and_a_recompute_is_whole)
{
    char *d = mk_dir();
    kv_store *s = reopened_after_persist(d, 1);
    int32_t t[2 * PT];
    km_pagehash h[2];
    tokens_of(1, t, 2 * PT);
    chain(t, 2 * PT, h);
    char hex[33], path[600];
    km_pagehash_hex(h[0], hex);
    snprintf(path, sizeof path, "%s/%s.kvp", d, hex);
    flip_byte(path, 20); /* inside the payload */
    cr_assert_eq(served(s, 1), 0);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.corrupt_pages, 1);
    cr_assert_eq(st.pages_indexed, 0, "page 1 hung from the corrupt page: it goes too");
    cr_assert_eq(count_files(d, ".kvp"), 0);
    cache_in_ram(s, 1); /* the recompute */
    cr_assert_eq(served(s, 1), 2, "the whole chain again");
    kv_store_destroy(s);
    rm_dir(d);
}

Test(kvshard_disk, leftover_temporaries_and_foreign_files_are_handled_at_open)
{
    char *d = mk_dir();
    char p[512];
    snprintf(p, sizeof p, "%s/.tmp-0123-1-1", d);
    FILE *f = fopen(p, "w");
    fputs("half a page", f);
    fclose(f);
    snprintf(p, sizeof p, "%s/00000000000000000000000000000000.kvp", d);
    f = fopen(p, "w");
    fputs("not a page", f);
    fclose(f);
    kv_store *s = open_store(d, 4);
    cr_assert_eq(count_files(d, "-1-1"), 0);
    cr_assert_eq(count_files(d, ".kvp"), 0, "garbage named like a page is removed");
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.corrupt_pages, 1);
    kv_store_destroy(s);
    rm_dir(d);
}

/* Replaces every page file in d by a FIFO ('f'), a sparse 3 GiB file ('g') or a symlink to the
 * same name in `target` ('l'). */
static int replace_pages(const char *d, char kind, const char *target)
{
    DIR *dir = opendir(d);
    struct dirent *de;
    int n = 0;
    while ((de = readdir(dir))) {
        if (!strstr(de->d_name, ".kvp")) continue;
        char p[512], t[512];
        snprintf(p, sizeof p, "%s/%s", d, de->d_name);
        if (kind != 'l') cr_assert_eq(unlink(p), 0);
        if (kind == 'f') cr_assert_eq(mkfifo(p, 0644), 0);
        if (kind == 'g') {
            int fd = open(p, O_WRONLY | O_CREAT, 0644);
            cr_assert_eq(ftruncate(fd, (off_t)3 << 30), 0);
            close(fd);
        }
        if (kind == 'l') {
            snprintf(t, sizeof t, "%s/%s", target, de->d_name);
            cr_assert_eq(symlink(p, t), 0);
        }
        n++;
    }
    closedir(dir);
    return n;
}

static long max_rss_mib(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024;
}

Test(kvshard_disk, only_regular_files_of_a_page_size_are_read_at_open, .timeout = 60)
{
    /* a FIFO named like a page used to block the open forever, a sparse 3 GiB one was read
     * whole into memory, a symlink was followed: now each is skipped, left alone and counted */
    char *real = mk_dir(), *d = mk_dir();
    kv_store *s = open_store(real, 4);
    persist(s, 1);
    kv_store_destroy(s);
    cr_assert_eq(replace_pages(real, 'l', d), 2, "symlinks in d to real pages");
    char p[512];
    snprintf(p, sizeof p, "%s/11111111111111111111111111111111.kvp", d);
    cr_assert_eq(mkfifo(p, 0644), 0);
    snprintf(p, sizeof p, "%s/22222222222222222222222222222222.kvp", d);
    int fd = open(p, O_WRONLY | O_CREAT, 0644);
    cr_assert_eq(ftruncate(fd, (off_t)3 << 30), 0);
    close(fd);
    long rss0 = max_rss_mib();
    s = open_store(d, 4);
    cr_assert_lt(max_rss_mib() - rss0, 512, "the sparse file was read: %ld MiB more",
                 max_rss_mib() - rss0);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.skipped_files, 4, "two symlinks, a FIFO, a giant file");
    cr_assert_eq(st.corrupt_pages, 0);
    cr_assert_eq(served(s, 1), 0, "a symlinked page is not served");
    cr_assert_eq(count_files(d, ".kvp"), 4, "none of them deleted");
    kv_store_destroy(s);
    s = open_store(real, 4);
    cr_assert_eq(served(s, 1), 2, "the symlinks' targets are untouched");
    kv_store_destroy(s);
    rm_dir(d);
    rm_dir(real);
}

Test(kvshard_disk, a_page_file_replaced_after_open_by_a_fifo_or_a_giant_file_is_refused_on_read,
     .timeout = 60)
{
    const char kinds[] = {'f', 'g'};
    for (int k = 0; k < 2; k++) {
        char *d = mk_dir();
        kv_store *s = open_store(d, 4);
        persist(s, 1);
        kv_store_destroy(s);
        s = open_store(d, 4);
        cr_assert_eq(replace_pages(d, kinds[k], NULL), 2);
        long rss0 = max_rss_mib();
        cr_assert_eq(served(s, 1), 0, "kind %c", kinds[k]);
        cr_assert_lt(max_rss_mib() - rss0, 512, "kind %c: read whole", kinds[k]);
        kv_store_stats st;
        kv_store_stats_get(s, &st);
        cr_assert_geq(st.corrupt_pages, 1, "kind %c", kinds[k]);
        kv_store_destroy(s);
        rm_dir(d);
    }
}

/* The writer: re-opens the directory (re-indexing what earlier rounds left), then persists
 * pages until it is killed. */
static void crash_writer(const char *dir, int round)
{
    kv_config c = {.n_layers = L,
                   .n_kv_heads = H,
                   .head_dim = HD,
                   .page_tokens = PT,
                   .disk_dir = dir,
                   .sync_promote = 1};
    c.hot_bytes = 4 * (size_t)PT * HD * 2 * 2 * L * H;
    kv_store *s;
    if (kv_store_create(&c, &s, NULL)) _exit(3);
    for (int k = 0;; k++) {
        int32_t t[2 * PT];
        km_pagehash h[2];
        tokens_of(round * 1000 + k, t, 2 * PT);
        chain(t, 2 * PT, h);
        kv_seq *q;
        kv_seq_create(s, &q);
        if (kv_seq_reserve(s, q, 2 * PT)) _exit(4);
        float kk[H * HD];
        for (int p = 0; p < 2 * PT; p++)
            for (int l = 0; l < L; l++) {
                for (int i = 0; i < H * HD; i++) kk[i] = kval(t[p], l, i / HD, i % HD);
                kv_seq_write(s, q, l, p, kk, kk);
            }
        kv_seq_publish(s, q, h, t, 2 * PT);
        kv_seq_destroy(s, q);
        kv_store_evict_oldest_fraction(s, 1.0);
    }
}

Test(kvshard_disk, sigkill_during_writes_never_leaves_a_servable_torn_page, .timeout = 60)
{
    char *d = mk_dir();
    srand((unsigned)time(NULL));
    int rounds = 12, survivors = 0, written_max = 0;
    for (int r = 0; r < rounds; r++) {
        pid_t pid = fork();
        cr_assert_geq(pid, 0);
        if (pid == 0) crash_writer(d, r);
        usleep(20000 + rand() % 60000); /* the kill lands at a random point of the writes */
        kill(pid, SIGKILL);
        int status;
        waitpid(pid, &status, 0);
        cr_assert(WIFSIGNALED(status), "the writer ran until killed (status %d)", status);
        kv_store *s = open_store(d, 64);
        kv_store_stats st;
        kv_store_stats_get(s, &st);
        cr_assert_eq(st.corrupt_pages, 0, "a rename-published page is never torn");
        /* Every page of every round so far either is served exactly or not at all. */
        for (int rr = 0; rr <= r; rr++)
            for (int k = 0; k < 5000; k++) {
                int n = served(s, rr * 1000 + k);
                survivors += n;
                if (n && k > written_max) written_max = k;
            }
        kv_store_destroy(s);
    }
    cr_assert_gt(survivors, 0, "pages written before a kill are reused after restart");
    cr_assert_lt(written_max, 4999, "the verification window covered every write");
    rm_dir(d);
}

/* ---------------------------------------------------------------- authenticated pages */

static const uint8_t secret_a[KM_SECRET_BYTES] = {0xa1, 0xa2, 0xa3};
static const uint8_t secret_b[KM_SECRET_BYTES] = {0xb1};

/* Rewrites every page file of d through fn (which may change b; the checksum is then fixed up),
 * as anyone with write access to the directory can. How many. */
static int rewrite_pages(const char *d, void (*fn)(uint8_t *b, size_t *len, void *arg), void *arg)
{
    DIR *dir = opendir(d);
    cr_assert_not_null(dir);
    struct dirent *de;
    int n = 0;
    while ((de = readdir(dir))) {
        if (!strstr(de->d_name, ".kvp")) continue;
        char p[512];
        snprintf(p, sizeof p, "%s/%s", d, de->d_name);
        FILE *f = fopen(p, "rb");
        cr_assert_not_null(f);
        uint8_t *b = malloc(1 << 16);
        size_t len = fread(b, 1, 1 << 16, f);
        fclose(f);
        fn(b, &len, arg);
        uint64_t h = XXH3_64bits(b, len - 8);
        for (int i = 0; i < 8; i++) b[len - 8 + i] = (uint8_t)(h >> (8 * i));
        f = fopen(p, "wb");
        cr_assert_eq(fwrite(b, 1, len, f), len);
        fclose(f);
        free(b);
        n++;
    }
    closedir(dir);
    return n;
}

/* Alters the KV of one page file (its checksum is fixed up after). */
static void forge_one(uint8_t *b, size_t *len, void *arg)
{
    kv_disk_page pg;
    cr_assert_eq(kv_disk_page_parse(b, *len, &pg), 0);
    for (size_t i = 0; i < pg.payload_bytes; i += 2) b[(pg.payload - b) + i + 1] ^= 0x04;
}

/* Alters the KV of every page file in d and recomputes its checksum, as anyone with write access
 * to the directory can; a MAC or seal, when the file has one, stays as it was (a new one takes
 * the secret). How many. */
static int forge_all(const char *d)
{
    return rewrite_pages(d, forge_one, NULL);
}

static uint64_t unauthenticated(kv_store *s)
{
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.corrupt_pages, 0, "an unauthenticated page is not counted as corrupt");
    return st.unauthenticated_pages;
}

Test(kvshard_disk, with_a_secret_pages_are_sealed_and_served_after_a_restart)
{
    char *d = mk_dir();
    kv_store *s = open_store_secret(d, 4, secret_a);
    persist(s, 1);
    persist(s, 2);
    kv_store_destroy(s);
    DIR *dir = opendir(d);
    struct dirent *de;
    while ((de = readdir(dir))) { /* every file is sealed */
        if (!strstr(de->d_name, ".kvp")) continue;
        char p[512];
        snprintf(p, sizeof p, "%s/%s", d, de->d_name);
        FILE *f = fopen(p, "rb");
        uint8_t b[4096];
        size_t len = fread(b, 1, sizeof b, f);
        fclose(f);
        kv_disk_page pg;
        cr_assert_eq(kv_disk_page_parse(b, len, &pg), 0);
        cr_assert_not_null(pg.seal, "%s is not sealed", de->d_name);
        cr_assert_null(pg.mac);
    }
    closedir(dir);
    s = open_store_secret(d, 4, secret_a);
    cr_assert_eq(served(s, 1), 2);
    cr_assert_eq(served(s, 2), 2);
    cr_assert_eq(unauthenticated(s), 0);
    kv_store_destroy(s);
    /* a store without the secret cannot read them: they are left alone, for one that has it */
    s = open_store(d, 4);
    cr_assert_eq(served(s, 1), 0);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.skipped_files, 4);
    cr_assert_eq(st.corrupt_pages + st.unauthenticated_pages, 0);
    kv_store_destroy(s);
    cr_assert_eq(count_files(d, ".kvp"), 4);
    s = open_store_secret(d, 4, secret_a);
    cr_assert_eq(served(s, 2), 2);
    kv_store_destroy(s);
    rm_dir(d);
}

Test(kvshard_disk, a_forged_page_is_served_without_a_secret_and_refused_with_one)
{
    /* the threat: a checksum guards against tearing, not tampering */
    char *d = mk_dir();
    kv_store *s = open_store(d, 4);
    persist(s, 1);
    kv_store_destroy(s);
    cr_assert_eq(forge_all(d), 2);
    s = open_store(d, 4);
    int wrong = 0;
    cr_assert_eq(served_values(s, 1, &wrong), 2);
    cr_assert_gt(wrong, 0, "the forgery changed nothing: the test proves nothing");
    kv_store_destroy(s);
    rm_dir(d);
    /* the same forgery under a cluster secret */
    d = mk_dir();
    s = open_store_secret(d, 4, secret_a);
    persist(s, 1);
    kv_store_destroy(s);
    cr_assert_eq(forge_all(d), 2);
    s = open_store_secret(d, 4, secret_a);
    cr_assert_eq(unauthenticated(s), 2);
    cr_assert_eq(served(s, 1), 0, "a forged page was served");
    cr_assert_eq(count_files(d, ".kvp"), 0, "forged pages are deleted");
    kv_store_destroy(s);
    rm_dir(d);
}

Test(kvshard_disk, pages_without_a_mac_or_under_another_secret_are_refused)
{
    char *d = mk_dir();
    kv_store *s = open_store_secret(d, 4, secret_b); /* another cluster's */
    persist(s, 2);
    kv_store_destroy(s);
    s = open_store(d, 4); /* no secret: keeps seed 2's pages, writes seed 1's without a MAC */
    persist(s, 1);
    kv_store_destroy(s);
    s = open_store_secret(d, 4, secret_a);
    cr_assert_eq(unauthenticated(s), 4);
    cr_assert_eq(served(s, 1), 0);
    cr_assert_eq(served(s, 2), 0);
    kv_store_destroy(s);
    rm_dir(d);
}

Test(kvshard_disk, a_page_forged_after_open_is_refused_on_read)
{
    char *d = mk_dir();
    kv_store *s = open_store_secret(d, 4, secret_a);
    persist(s, 1);
    kv_store_destroy(s);
    s = open_store_secret(d, 4, secret_a); /* indexed on the disk tier, not read yet */
    cr_assert_eq(unauthenticated(s), 0);
    cr_assert_eq(forge_all(d), 2);
    cr_assert_eq(served(s, 1), 0, "a page forged after open was served");
    cr_assert_geq(unauthenticated(s), 1);
    cr_assert_eq(served(s, 1), 0, "and it stays gone");
    kv_store_destroy(s);
    rm_dir(d);
}

Test(kvshard_disk, the_mac_covers_header_tokens_and_payload)
{
    uint8_t key[KV_DISK_MAC_BYTES], other[KV_DISK_MAC_BYTES], tokens[4 * PT], payload[2048];
    km_secret_derive(secret_a, "kvmpage1", 1, key);
    km_secret_derive(secret_b, "kvmpage1", 1, other);
    for (size_t i = 0; i < sizeof tokens; i++) tokens[i] = (uint8_t)i;
    for (size_t i = 0; i < sizeof payload; i++) payload[i] = (uint8_t)(i * 7);
    kv_layout lay;
    kv_layout_init(&lay, KN_KV_F16, PT, HD, L, H);
    cr_assert_leq(lay.page_bytes, sizeof payload);
    kv_disk_page pg = {.format = KN_KV_F16,
                       .page_tokens = PT,
                       .n_layers = L,
                       .n_kv_heads = H,
                       .head_dim = HD,
                       .hash = {1, 2},
                       .parent = {3, 4},
                       .index = 1,
                       .tokens = tokens,
                       .payload = payload,
                       .payload_bytes = lay.page_bytes};
    size_t n = kv_disk_page_size(lay.page_bytes, PT) + KV_DISK_MAC_BYTES;
    uint8_t *b = malloc(n), *copy = malloc(n);
    cr_assert_eq(kv_disk_page_encode_mac(&pg, key, b, n - 1), 0, "wrote past cap");
    cr_assert_eq(kv_disk_page_encode_mac(&pg, key, b, n), n);
    kv_disk_page got;
    cr_assert_eq(kv_disk_page_parse(b, n, &got), 0);
    cr_assert_eq(kv_disk_page_verify_mac(b, n, &got, key), 0);
    cr_assert_eq(kv_disk_page_verify_mac(b, n, &got, other), KM_ECORRUPT);
    cr_assert_eq(kv_disk_page_encode(&got, copy, n), n, "a parsed page re-encodes with its MAC");
    cr_assert_arr_eq(copy, b, n);
    /* any byte before the MAC changed (checksum fixed up) fails it */
    const size_t offs[] = {12, 32, 64, 80, 80 + 4 * PT, n - 8 - KV_DISK_MAC_BYTES - 1};
    for (size_t i = 0; i < sizeof offs / sizeof *offs; i++) {
        memcpy(copy, b, n);
        copy[offs[i]] ^= 1;
        uint64_t h = XXH3_64bits(copy, n - 8);
        for (int j = 0; j < 8; j++) copy[n - 8 + j] = (uint8_t)(h >> (8 * j));
        if (kv_disk_page_parse(copy, n, &got)) continue; /* a header field now out of range */
        cr_assert_eq(kv_disk_page_verify_mac(copy, n, &got, key), KM_ECORRUPT, "offset %zu",
                     offs[i]);
    }
    /* a flag bit nobody defined is malformed, and a page without a MAC does not verify */
    memcpy(copy, b, n);
    copy[68] |= 2;
    uint64_t h = XXH3_64bits(copy, n - 8);
    for (int j = 0; j < 8; j++) copy[n - 8 + j] = (uint8_t)(h >> (8 * j));
    cr_assert_eq(kv_disk_page_parse(copy, n, &got), KM_EFORMAT);
    size_t m = kv_disk_page_encode(&pg, copy, n);
    cr_assert_eq(m, n - KV_DISK_MAC_BYTES);
    cr_assert_eq(kv_disk_page_parse(copy, m, &got), 0);
    cr_assert_null(got.mac);
    cr_assert_eq(kv_disk_page_verify_mac(copy, m, &got, key), KM_ECORRUPT);
    free(b);
    free(copy);
}

/* ---------------------------------------------------------------- who may read the files */

static unsigned mode_of(const char *path)
{
    struct stat st;
    cr_assert_eq(stat(path, &st), 0, "%s", path);
    return (unsigned)st.st_mode & 07777;
}

Test(kvshard_disk, the_directory_is_0700_and_page_files_0600_whatever_the_umask)
{
    const mode_t masks[] = {0, 022, 0277};
    for (size_t i = 0; i < sizeof masks / sizeof *masks; i++) {
        char *top = mk_dir(), sub[256];
        snprintf(sub, sizeof sub, "%s/kv", top);
        mode_t old = umask(masks[i]);
        kv_store *s = open_store_secret(sub, 4, i % 2 ? secret_a : NULL);
        persist(s, 1);
        kv_store_destroy(s);
        umask(old);
        cr_assert_eq(mode_of(sub), 0700, "umask %03o: directory %04o", masks[i], mode_of(sub));
        DIR *dir = opendir(sub);
        struct dirent *de;
        int files = 0;
        while ((de = readdir(dir))) {
            if (!strstr(de->d_name, ".kvp")) continue;
            char p[512];
            snprintf(p, sizeof p, "%s/%s", sub, de->d_name);
            cr_assert_eq(mode_of(p), 0600, "umask %03o: %s %04o", masks[i], p, mode_of(p));
            files++;
        }
        closedir(dir);
        cr_assert_eq(files, 2);
        char *d = strdup(sub);
        rm_dir(d);
        rmdir(top);
        free(top);
    }
}

Test(kvshard_disk, a_directory_others_may_write_is_refused_and_one_they_may_read_is_narrowed)
{
    const unsigned refused[] = {0777, 0770, 0722, 01777};
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        char *d = mk_dir();
        cr_assert_eq(chmod(d, refused[i]), 0);
        kv_config c = {.n_layers = L,
                       .n_kv_heads = H,
                       .head_dim = HD,
                       .page_tokens = PT,
                       .disk_dir = d,
                       .hot_bytes = 1 << 20};
        kv_store *s = NULL;
        km_errbuf err = {{0}};
        cr_assert_neq(kv_store_create(&c, &s, &err), 0, "mode %04o was accepted", refused[i]);
        cr_assert(strstr(err.msg, d) && strstr(err.msg, "chmod 700"), "%s", err.msg);
        cr_assert_eq(mode_of(d), refused[i], "a refused directory is left as it was");
        rm_dir(d);
    }
    char *d = mk_dir();
    cr_assert_eq(chmod(d, 0755), 0); /* what this store made before */
    kv_store *s = open_store(d, 4);
    kv_store_destroy(s);
    cr_assert_eq(mode_of(d), 0700);
    rm_dir(d);
}

static bool contains(const uint8_t *hay, size_t n, const void *needle, size_t m)
{
    for (size_t i = 0; i + m <= n; i++)
        if (!memcmp(hay + i, needle, m)) return true;
    return false;
}

/* Whether any page file of d holds the bytes [p, p+n). */
static bool any_file_holds(const char *d, const void *p, size_t n)
{
    DIR *dir = opendir(d);
    struct dirent *de;
    bool found = false;
    while (!found && (de = readdir(dir))) {
        if (!strstr(de->d_name, ".kvp")) continue;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", d, de->d_name);
        FILE *f = fopen(path, "rb");
        uint8_t b[1 << 16];
        size_t len = fread(b, 1, sizeof b, f);
        fclose(f);
        found = contains(b, len, p, n);
    }
    closedir(dir);
    return found;
}

Test(kvshard_disk, with_a_secret_page_files_hold_no_token_ids_or_kv_in_clear)
{
    int32_t t[2 * PT];
    tokens_of(1, t, 2 * PT);
    uint8_t run[2][PT * 4], kv[64];
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < PT; i++)
            for (int k = 0; k < 4; k++)
                run[p][4 * i + k] = (uint8_t)((uint32_t)t[p * PT + i] >> 8 * k);
    /* without a secret both are there in clear: the search finds what it looks for */
    char *d = mk_dir();
    kv_store *s = open_store(d, 4);
    persist(s, 1);
    kv_store_destroy(s);
    cr_assert(any_file_holds(d, run[0], sizeof run[0]) && any_file_holds(d, run[1], sizeof run[1]));
    DIR *dir = opendir(d);
    struct dirent *de;
    while ((de = readdir(dir)) && !strstr(de->d_name, ".kvp")) {
    }
    char path[512];
    snprintf(path, sizeof path, "%s/%s", d, de->d_name);
    closedir(dir);
    FILE *f = fopen(path, "rb");
    cr_assert_eq(fseek(f, 80 + PT * 4, SEEK_SET), 0); /* the payload's first bytes */
    cr_assert_eq(fread(kv, 1, sizeof kv, f), sizeof kv);
    fclose(f);
    rm_dir(d);
    /* sealed: neither */
    d = mk_dir();
    s = open_store_secret(d, 4, secret_a);
    persist(s, 1);
    kv_store_destroy(s);
    cr_assert_eq(count_files(d, ".kvp"), 2);
    cr_assert_not(any_file_holds(d, run[0], sizeof run[0]), "token ids in clear");
    cr_assert_not(any_file_holds(d, run[1], sizeof run[1]), "token ids in clear");
    cr_assert_not(any_file_holds(d, kv, sizeof kv), "KV in clear");
    s = open_store_secret(d, 4, secret_a);
    cr_assert_eq(served(s, 1), 2);
    kv_store_destroy(s);
    rm_dir(d);
}

static void flip_at(uint8_t *b, size_t *len, void *arg)
{
    long off = *(long *)arg;
    b[off >= 0 ? (size_t)off : *len + (size_t)off] ^= 0x10;
}

Test(kvshard_disk, with_a_secret_a_flipped_byte_anywhere_is_dropped_never_served)
{
    /* the parent link in the header, a token id, the KV, the nonce, the tag */
    long offs[] = {48, 80 + 1, 80 + PT * 4 + 5, -8 - KV_DISK_SEAL_BYTES, -9};
    for (size_t i = 0; i < sizeof offs / sizeof *offs; i++) {
        char *d = mk_dir();
        kv_store *s = open_store_secret(d, 4, secret_a);
        persist(s, 1);
        kv_store_destroy(s);
        cr_assert_eq(rewrite_pages(d, flip_at, &offs[i]), 2);
        s = open_store_secret(d, 4, secret_a);
        cr_assert_eq(unauthenticated(s), 2, "offset %ld", offs[i]);
        cr_assert_eq(served(s, 1), 0, "offset %ld: a page was served", offs[i]);
        kv_store_destroy(s);
        cr_assert_eq(count_files(d, ".kvp"), 0);
        rm_dir(d);
    }
}

/* Re-encodes a page in the format before sealing: token ids in clear and a MAC under arg. */
static void to_mac_format(uint8_t *b, size_t *len, void *arg)
{
    kv_disk_page pg;
    cr_assert_eq(kv_disk_page_parse(b, *len, &pg), 0);
    uint8_t *out = malloc(*len + KV_DISK_MAC_BYTES);
    *len = kv_disk_page_encode_mac(&pg, arg, out, *len + KV_DISK_MAC_BYTES);
    cr_assert_gt(*len, 0);
    memcpy(b, out, *len);
    free(out);
}

Test(kvshard_disk, pages_of_the_format_before_sealing_are_sealed_again_at_open)
{
    uint8_t mac_key[KV_DISK_MAC_BYTES];
    km_secret_derive(secret_a, "kvmpage1", 1, mac_key);
    char *d = mk_dir();
    kv_store *s = open_store(d, 4);
    persist(s, 1);
    kv_store_destroy(s);
    cr_assert_eq(rewrite_pages(d, to_mac_format, mac_key), 2);
    s = open_store_secret(d, 4, secret_a);
    cr_assert_eq(unauthenticated(s), 0);
    cr_assert_eq(served(s, 1), 2);
    kv_store_destroy(s);
    DIR *dir = opendir(d);
    struct dirent *de;
    int sealed = 0;
    while ((de = readdir(dir))) {
        if (!strstr(de->d_name, ".kvp")) continue;
        char p[512];
        snprintf(p, sizeof p, "%s/%s", d, de->d_name);
        FILE *f = fopen(p, "rb");
        uint8_t b[1 << 16];
        size_t len = fread(b, 1, sizeof b, f);
        fclose(f);
        kv_disk_page pg;
        cr_assert_eq(kv_disk_page_parse(b, len, &pg), 0);
        sealed += pg.seal != NULL;
    }
    closedir(dir);
    cr_assert_eq(sealed, 2, "the older pages were not sealed again");
    rm_dir(d);
}

/* A store (c: the test's options) over a fresh directory holding the first two pages of seed
 * 1, persisted, and re-indexed from their files when `reopen`: their tokens and hashes, the path
 * of page 1's file, the directory. */
static kv_store *two_pages_on_disk(kv_config c, int reopen, int32_t t[2 * PT], km_pagehash h[2],
                                   char path[600], char **dir)
{
    *dir = mk_dir();
    c.n_layers = L;
    c.n_kv_heads = H;
    c.head_dim = HD;
    c.page_tokens = PT;
    c.disk_dir = *dir;
    c.hot_bytes = 8 * (size_t)PT * HD * 2 * 2 * L * H;
    kv_store *s;
    km_errbuf err;
    cr_assert_eq(kv_store_create(&c, &s, &err), 0, "%s", err.msg);
    persist(s, 1);
    if (reopen) {
        kv_store_destroy(s);
        cr_assert_eq(kv_store_create(&c, &s, &err), 0, "%s", err.msg);
    }
    tokens_of(1, t, 2 * PT);
    chain(t, 2 * PT, h);
    char hex[33];
    km_pagehash_hex(h[1], hex);
    snprintf(path, 600, "%s/%s.kvp", *dir, hex);
    return s;
}

Test(kvshard_disk, a_lazy_attach_leaves_pages_on_disk_and_a_fetch_reads_only_those_asked_for)
{
    char *d, path[600];
    int32_t t[2 * PT];
    km_pagehash h[2];
    kv_store *s =
        two_pages_on_disk((kv_config){.promote_selected = 1, .summaries = 1}, 0, t, h, path, &d);
    km_errbuf err;
    flip_byte(path, 20); /* inside page 1's payload */

    kv_seq *q;
    cr_assert_eq(kv_seq_create(s, &q), 0);
    cr_assert_eq(kv_seq_attach(s, q, h, t, 2), 2);
    cr_assert_eq(kv_seq_cold_pages(q), 2);
    kv_seq *f;
    cr_assert_eq(kv_seq_fork(s, q, &f), 0);
    cr_assert_eq(kv_seq_cold_pages(f), 2, "a fork shares the pages where they are");
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    kv_seq_destroy(s, f);
    float k[HD], v[HD];
    cr_assert_eq(kv_seq_read(s, q, 0, 0, 0, k, v), KM_EAGAIN, "page 0 is still on disk");
    const int want1 = 1;
    cr_assert_eq(kv_seq_fetch(s, q, 1, &want1, 1), 1);
    kv_seq_wait_ready(s, q);
    cr_assert_eq(kv_seq_cold_pages(q), 1, "page 0 was not asked for");
    cr_assert_eq(kv_seq_read(s, q, 1, 1, PT, k, v), 0);
    for (int i = 0; i < HD; i++) cr_assert(k[i] == 0.0f && v[i] == 0.0f, "zeros, not its bytes");
    const int want0 = 0;
    cr_assert_eq(kv_seq_fetch(s, q, 0, &want0, 1), 1);
    cr_assert_eq(kv_seq_cold_pages(q), 0);
    for (int l = 0; l < L; l++) {
        cr_assert_eq(kv_seq_read(s, q, l, 1, 2, k, v), 0);
        for (int i = 0; i < HD; i++) cr_assert_eq(k[i], kval(t[2], l, 1, i));
    }
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.corrupt_pages, 1);
    cr_assert_eq(st.promoted_pages[KV_PROMOTE_READ], 2);
    cr_assert_eq(st.promoted_pages[KV_PROMOTE_PREFIX], 0);
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    kv_seq_destroy(s, q);
    cr_assert_eq(served(s, 1), 1, "the page that failed is never served");
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    kv_store_destroy(s);
    rm_dir(d);
}

/* K of (layer, head), row `row` of page i as a view of the sequence reads it (f16 pages). */
static float view_k(kv_store *s, kv_seq *q, int layer, int head, int i, int row, int c)
{
    kn_kv_view v;
    kv_seq_view(s, q, layer, head, 2 * PT, &v);
    cr_assert_not_null(v.pages[i], "page %d has nothing a view can read", i);
    const kn_f16 *k = (const kn_f16 *)(v.pages[i] + v.k_off);
    return kn_f16_to_f32(k[row * HD + c]);
}

/* kv_config.fetch_slices: a fetch reads one layer of a disk page (after a restart too: the layer
 * checksums are taken again at re-index), verified alone; a flipped byte in another layer's
 * slice costs only that slice (zeros, the page never served again); a page read that often comes
 * up whole; nothing is left pointing at a slice after kv_seq_fetch_end. */
Test(kvshard_disk, a_fetch_reads_only_the_layer_slice_asked_for_verified_alone)
{
    char *d, path[600];
    int32_t t[2 * PT];
    km_pagehash h[2];
    kv_store *s = two_pages_on_disk((kv_config){.promote_selected = 1, .fetch_slices = 2}, 1, t, h,
                                    path, &d); /* re-indexed */
    km_errbuf err;
    const size_t page = kv_store_page_bytes(s), per = page / L;
    /* a byte of page 1's layer 1, counted from the file's end */
    const size_t at = kv_disk_page_payload_offset(PT) + per + 10;
    flip_byte(path, (long)(kv_disk_page_size(page, PT) - at));

    kv_seq *q;
    cr_assert_eq(kv_seq_create(s, &q), 0);
    cr_assert_eq(kv_seq_attach(s, q, h, t, 2), 2);
    const int both[2] = {0, 1};
    cr_assert_eq(kv_seq_fetch(s, q, 0, both, 2), 0, "read as slices: nothing comes up");
    cr_assert_eq(kv_seq_cold_pages(q), 2);
    for (int i = 0; i < 2; i++)
        for (int hh = 0; hh < H; hh++)
            cr_assert_eq(view_k(s, q, 0, hh, i, 3, 5), kval(t[i * PT + 3], 0, hh, 5));
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.slice_disk_reads, 2);
    cr_assert_eq(st.slice_disk_bytes, 2 * per);
    cr_assert_eq(st.promoted_pages[KV_PROMOTE_READ], 0);

    cr_assert_eq(kv_seq_fetch(s, q, 1, both, 2), 0);
    cr_assert_eq(view_k(s, q, 1, 1, 0, 2, 7), kval(t[2], 1, 1, 7));
    cr_assert_eq(view_k(s, q, 1, 1, 1, 2, 7), 0.0f, "the slice that failed reads as zeros");
    kv_seq_fetch_end(s, q);
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    kv_store_stats_get(s, &st);
    cr_assert_eq(st.corrupt_pages, 1);
    cr_assert_eq(st.slice_disk_reads, 4);

    cr_assert_eq(kv_seq_fetch(s, q, 0, both, 1), 1, "read twice: page 0 comes up whole");
    cr_assert_eq(kv_seq_cold_pages(q), 1);
    for (int l = 0; l < L; l++) cr_assert_eq(view_k(s, q, l, 0, 0, 1, 2), kval(t[1], l, 0, 2));
    kv_seq_fetch_end(s, q);
    cr_assert_eq(kv_store_check(s, &err), 0, "%s", err.msg);
    kv_seq_destroy(s, q);
    cr_assert_eq(served(s, 1), 1, "the page whose slice failed is never served");
    kv_store_destroy(s);
    rm_dir(d);
}
