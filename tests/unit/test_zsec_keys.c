/*
 * test_zsec_keys.c — the files behind security: the key directory (layout, modes, names, roles
 * decided by directory, worker bindings), the keyring's reloads and its tolerance of bad files
 * (malformed, duplicate, misplaced secret, a client file claiming to be a member), HTTP API keys
 * (format, hashing, Bearer parsing, reload, revocation, salts per key and shared on purpose, salt
 * namespaces), and the cluster secret and MAC. Also that nothing here lets CZMQ install signal
 * handlers over the daemons'.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/sec.h"
#include "tests/unit/sec_fixture.h"

static char dir[64];

static void setup(void)
{
    km_log_set_level(KM_LOG_ERROR);
    snprintf(dir, sizeof dir, "/tmp/kvmesh-keys-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    rmdir(dir); /* km_keydir_init makes it */
}

static void teardown(void)
{
    rm_tree(dir);
}

/* cppcheck-suppress unknownMacro ; criterion macros are unknown to cppcheck */
TestSuite(keys, .init = setup, .fini = teardown, .timeout = 60);

static unsigned mode_of(const char *fmt, const char *a)
{
    char p[512];
    snprintf(p, sizeof p, fmt, dir, a);
    struct stat st;
    cr_assert_eq(stat(p, &st), 0, "%s missing", p);
    return (unsigned)(st.st_mode & 0777);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

/* ---------------------------------------------------------------- key directory */

Test(keys, the_key_directory_has_its_layout_and_secret_files_are_0600)
{
    km_errbuf err = {{0}};
    must(km_keydir_init(dir, &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_MEMBER, "w0", "w0", &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_CLIENT, "alice", NULL, &err), &err);
    cr_assert_eq(mode_of("%s%s", ""), 0700);
    cr_assert_eq(mode_of("%s/%s", "private"), 0700);
    cr_assert_eq(mode_of("%s/%s", "cluster.secret"), 0600);
    cr_assert_eq(mode_of("%s/private/%s.key_secret", "w0"), 0600);
    cr_assert_eq(mode_of("%s/private/%s.key_secret", "alice"), 0600);
    mode_of("%s/members/%s.key", "w0");
    mode_of("%s/clients/%s.key", "alice");
    /* init again leaves everything, the secret included, as it was */
    uint8_t s1[KM_SECRET_BYTES], s2[KM_SECRET_BYTES];
    char p[256];
    snprintf(p, sizeof p, "%s/cluster.secret", dir);
    must(km_secret_load(p, s1, &err), &err);
    must(km_keydir_init(dir, &err), &err);
    must(km_secret_load(p, s2, &err), &err);
    cr_assert_arr_eq(s1, s2, sizeof s1);
    km_cert_info info;
    must(km_keydir_find(dir, KM_ROLE_MEMBER, "w0", &info, &err), &err);
    cr_assert_str_eq(info.worker, "w0");
    cr_assert_eq(strlen(info.public_txt), 40);
}

Test(keys, a_cluster_key_directory_is_made_once_and_grows_with_its_workers)
{
    km_errbuf err = {{0}};
    const char *two[] = {"w0", "w1"}, *three[] = {"w0", "w1", "w2"};
    cr_assert_eq(km_keydir_init_cluster(dir, two, 2, &err), 6, "%s", err.msg);
    km_cert_info l[16];
    cr_assert_eq(km_keydir_list(dir, KM_ROLES_ALL, l, 16, &err), 6);
    const char *names[] = {"controller", "router", "w0", "w1", "admin", "client"};
    const km_role roles[] = {KM_ROLE_MEMBER, KM_ROLE_MEMBER,   KM_ROLE_MEMBER,
                             KM_ROLE_MEMBER, KM_ROLE_OPERATOR, KM_ROLE_CLIENT};
    for (int i = 0; i < 6; i++) {
        cr_assert_str_eq(l[i].name, names[i]);
        cr_assert_eq(l[i].role, roles[i]);
    }
    cr_assert_str_eq(l[2].worker, "w0");
    cr_assert_str_eq(l[0].worker, "");
    char before[41];
    memcpy(before, l[2].public_txt, 41);
    cr_assert_eq(km_keydir_init_cluster(dir, three, 3, &err), 1, "only w2 is new");
    km_cert_info w0;
    must(km_keydir_find_worker(dir, "w0", &w0, &err), &err);
    cr_assert_str_eq(w0.public_txt, before, "an existing key was replaced");
    /* a name taken by a key bound to another worker is an error, not a silent mix-up */
    must(km_keydir_remove(dir, "w2", &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_MEMBER, "w2", "w7", &err), &err);
    cr_assert_eq(km_keydir_init_cluster(dir, three, 3, &err), KM_EINVAL);
}

Test(keys, names_are_unique_checked_and_only_members_bind_worker_ids)
{
    km_errbuf err = {{0}};
    must(km_keydir_init(dir, &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_MEMBER, "w0", "w0", &err), &err);
    cr_assert_eq(km_keydir_new_cert(dir, KM_ROLE_CLIENT, "w0", NULL, &err), KM_EINVAL);
    cr_assert(strstr(err.msg, "exists"), "%s", err.msg);
    cr_assert_eq(km_keydir_new_cert(dir, KM_ROLE_CLIENT, "bob", "w1", &err), KM_EINVAL);
    cr_assert_eq(km_keydir_new_cert(dir, KM_ROLE_NONE, "bob", NULL, &err), KM_EINVAL);
    cr_assert_eq(km_keydir_new_cert(dir, KM_ROLE_MEMBER | KM_ROLE_CLIENT, "bob", NULL, &err),
                 KM_EINVAL);
    const char *bad[] = {"",
                         "../x",
                         ".hidden",
                         "a b",
                         "a/b",
                         "x\n",
                         "0123456789012345678901234567890123456789012345678901234567890123456"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        cr_assert_eq(km_keydir_new_cert(dir, KM_ROLE_CLIENT, bad[i], NULL, &err), KM_EINVAL,
                     "name '%s' accepted", bad[i]);
    cr_assert(km_sec_name_ok("router-0.eu_west"));
}

Test(keys, list_find_and_remove)
{
    km_errbuf err = {{0}};
    must(km_keydir_init(dir, &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_CLIENT, "zed", NULL, &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_MEMBER, "w1", "w1", &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_MEMBER, "host7", "w0", &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_OPERATOR, "admin", NULL, &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_CLIENT, "alice", NULL, &err), &err);
    km_cert_info l[8];
    cr_assert_eq(km_keydir_list(dir, KM_ROLES_ALL, l, 8, &err), 5);
    const char *order[] = {"host7", "w1", "admin", "alice", "zed"};
    for (int i = 0; i < 5; i++) cr_assert_str_eq(l[i].name, order[i]);
    cr_assert_eq(km_keydir_list(dir, KM_ROLE_CLIENT, l, 8, &err), 2);
    cr_assert_eq(km_keydir_list(dir, KM_ROLES_ALL, l, 2, &err), 5, "the total, not what fit");
    km_cert_info w;
    must(km_keydir_find_worker(dir, "w0", &w, &err), &err);
    cr_assert_str_eq(w.name, "host7");
    cr_assert_eq(km_keydir_find_worker(dir, "w9", &w, &err), KM_ENOTFOUND);
    must(km_keydir_remove(dir, "alice", &err), &err);
    cr_assert_eq(km_keydir_find(dir, 0, "alice", &w, &err), KM_ENOTFOUND);
    cr_assert_eq(km_keydir_remove(dir, "alice", &err), KM_ENOTFOUND);
    char p[256];
    snprintf(p, sizeof p, "%s/private/alice.key_secret", dir);
    cr_assert_neq(access(p, F_OK), 0, "the private half of a removed key was left behind");
}

Test(keys, add_public_refuses_bad_keys_and_keys_already_admitted)
{
    km_errbuf err = {{0}};
    must(km_keydir_init(dir, &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_CLIENT, "alice", NULL, &err), &err);
    km_cert_info a;
    must(km_keydir_find(dir, KM_ROLE_CLIENT, "alice", &a, &err), &err);
    cr_assert_eq(km_keydir_add_public(dir, KM_ROLE_OPERATOR, "alice2", a.public_txt, NULL, &err),
                 KM_EINVAL, "one key admitted twice");
    cr_assert_eq(km_keydir_add_public(dir, KM_ROLE_CLIENT, "bob", "short", NULL, &err), KM_EINVAL);
    cr_assert_eq(
        km_keydir_add_public(dir, KM_ROLE_CLIENT, "bob",
                             "\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\"\""
                             "\"\"\"\"\"\"\"\"\"",
                             NULL, &err),
        KM_EINVAL, "not Z85, yet accepted");
}

/* ---------------------------------------------------------------- keyring */

static km_keyring *ring_of(void)
{
    km_keyring *k;
    km_errbuf err = {{0}};
    must(km_keyring_open(dir, &k, &err), &err);
    return k;
}

static void copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "r"), *b = fopen(to, "w");
    cr_assert(a && b);
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, a))) fwrite(buf, 1, n, b);
    fclose(a);
    fclose(b);
}

Test(keys, the_keyring_takes_the_role_from_the_directory_not_from_the_file)
{
    km_errbuf err = {{0}};
    must(km_keydir_init(dir, &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_MEMBER, "w0", "w0", &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_CLIENT, "alice", NULL, &err), &err);
    km_cert_info w0, alice, got;
    must(km_keydir_find(dir, 0, "w0", &w0, &err), &err);
    must(km_keydir_find(dir, 0, "alice", &alice, &err), &err);
    char from[256], to[256];
    /* a member's file (role=member, worker=w0 inside) handed in as a client's key */
    snprintf(from, sizeof from, "%s/members/w0.key", dir);
    snprintf(to, sizeof to, "%s/clients/sneaky.key", dir);
    copy_file(from, to);
    km_keyring *k = ring_of();
    must(km_keyring_lookup(k, alice.public_txt, &got), &err);
    cr_assert_eq(got.role, KM_ROLE_CLIENT);
    cr_assert_str_eq(got.name, "alice");
    /* sneaky.key is refused (role and worker do not fit clients/), so w0 stays a member only */
    must(km_keyring_lookup(k, w0.public_txt, &got), &err);
    cr_assert_eq(got.role, KM_ROLE_MEMBER);
    cr_assert_str_eq(got.worker, "w0");
    cr_assert_eq(km_keyring_count(k), 2);
    km_keyring_close(k);
}

Test(keys, one_key_under_two_roles_is_refused_as_ambiguous)
{
    km_errbuf err = {{0}};
    must(km_keydir_init(dir, &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_CLIENT, "alice", NULL, &err), &err);
    km_cert_info a, got;
    must(km_keydir_find(dir, 0, "alice", &a, &err), &err);
    char from[256], to[256];
    snprintf(from, sizeof from, "%s/clients/alice.key", dir);
    snprintf(to, sizeof to, "%s/operators/alice.key", dir);
    /* a copy without the role line, as an operator might paste it */
    FILE *in = fopen(from, "r"), *out = fopen(to, "w");
    char line[256];
    while (fgets(line, sizeof line, in))
        if (!strstr(line, "role")) fputs(line, out);
    fclose(in);
    fclose(out);
    km_keyring *k = ring_of();
    cr_assert_eq(km_keyring_lookup(k, a.public_txt, &got), KM_EINVAL);
    km_keyring_close(k);
}

Test(keys, bad_files_are_skipped_and_never_crash_the_keyring)
{
    km_errbuf err = {{0}};
    must(km_keydir_init(dir, &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_CLIENT, "alice", NULL, &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_CLIENT, "bob", NULL, &err), &err);
    km_cert_info a, got;
    must(km_keydir_find(dir, 0, "alice", &a, &err), &err);
    char p[256], q[256];
    /* the same key twice: CZMQ 4.2.1's own loader aborts the process on this */
    snprintf(p, sizeof p, "%s/clients/alice.key", dir);
    snprintf(q, sizeof q, "%s/clients/alice-backup.key", dir);
    copy_file(p, q);
    snprintf(q, sizeof q, "%s/clients/garbage.key", dir);
    write_text(q, "\x01\x02 not a certificate {{{\n");
    snprintf(q, sizeof q, "%s/clients/empty.key", dir);
    write_text(q, "");
    snprintf(q, sizeof q, "%s/clients/nokey.key", dir);
    write_text(q, "curve\n    public-key = \"tooshort\"\n");
    snprintf(p, sizeof p, "%s/private/bob.key_secret", dir);
    snprintf(q, sizeof q, "%s/clients/bob.key_secret", dir);
    copy_file(p, q); /* a secret half where everyone can read it: ignored */
    snprintf(q, sizeof q, "%s/clients/.hidden.key", dir);
    write_text(q, "whatever");
    km_keyring *k = ring_of();
    must(km_keyring_lookup(k, a.public_txt, &got), &err);
    cr_assert_eq(km_keyring_count(k), 2, "alice and bob, once each");
    km_keyring_close(k);
}

Test(keys, the_keyring_reloads_only_what_changed_and_follows_symlinks)
{
    km_errbuf err = {{0}};
    must(km_keydir_init(dir, &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_CLIENT, "alice", NULL, &err), &err);
    km_keyring *k = ring_of();
    cr_assert_eq(km_keyring_refresh(k), 0, "nothing changed, yet it reloaded");
    /* a Kubernetes Secret volume: NAME.key -> ..data/NAME.key */
    char data[256], target[300], link[256];
    snprintf(data, sizeof data, "%s/clients/..data", dir);
    cr_assert_eq(mkdir(data, 0755), 0);
    must(km_keydir_new_cert(dir, KM_ROLE_CLIENT, "carol", NULL, &err), &err);
    snprintf(link, sizeof link, "%s/clients/carol.key", dir);
    snprintf(target, sizeof target, "%s/carol.key", data);
    cr_assert_eq(rename(link, target), 0);
    cr_assert_eq(symlink("..data/carol.key", link), 0);
    cr_assert_eq(km_keyring_refresh(k), 1);
    km_cert_info c, got;
    must(km_keydir_find(dir, KM_ROLE_CLIENT, "carol", &c, &err), &err);
    must(km_keyring_lookup(k, c.public_txt, &got), &err);
    cr_assert_str_eq(got.name, "carol");
    km_keyring_close(k);
}

static void handlers(struct sigaction *sa)
{
    sigaction(SIGINT, NULL, &sa[0]);
    sigaction(SIGTERM, NULL, &sa[1]);
}

Test(keys, czmq_never_installs_its_signal_handlers)
{
    struct sigaction before[2], after[2];
    handlers(before);
    km_errbuf err = {{0}};
    must(km_keydir_init(dir, &err), &err);
    must(km_keydir_new_cert(dir, KM_ROLE_MEMBER, "w0", "w0", &err), &err);
    char q[256];
    snprintf(q, sizeof q, "%s/members/broken.key", dir);
    write_text(q, "\x01\x02 not a certificate {{{\n"); /* zconfig logs through zsys */
    km_keyring *k = ring_of();
    km_cert_info got;
    km_keyring_lookup(k, "0000000000000000000000000000000000000000", &got);
    km_keyring_close(k);
    handlers(after);
    for (int i = 0; i < 2; i++)
        cr_assert_eq((void *)before[i].sa_handler, (void *)after[i].sa_handler,
                     "a CZMQ call installed a signal handler");
}

/* ---------------------------------------------------------------- API keys */

static char keyfile[256];

static km_apikeys *keys_open(void)
{
    km_apikeys *k;
    km_errbuf err = {{0}};
    must(km_apikeys_open(keyfile, &k, &err), &err);
    km_apikeys_set_check_interval(k, 0);
    return k;
}

static void add_key(const char *tenant, km_role role, const char *salt, char tok[64])
{
    km_errbuf err = {{0}};
    must(km_apikeys_add(keyfile, tenant, role, salt, tok, 64, &err), &err);
}

static void init_keyfile(void)
{
    km_errbuf err = {{0}};
    must(km_keydir_init(dir, &err), &err);
    snprintf(keyfile, sizeof keyfile, "%s/apikeys", dir);
}

Test(keys, api_keys_are_random_and_only_their_hash_is_stored)
{
    init_keyfile();
    char a[64], b[64];
    add_key("acme", KM_ROLE_CLIENT, NULL, a);
    add_key("ops", KM_ROLE_OPERATOR, NULL, b);
    cr_assert_eq(strlen(a), 47);
    cr_assert(!strncmp(a, "kvm_", 4));
    cr_assert_str_neq(a, b);
    for (const char *c = a + 4; *c; c++)
        cr_assert(strchr("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", *c));
    struct stat st;
    cr_assert_eq(stat(keyfile, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0600);
    FILE *f = fopen(keyfile, "r");
    char text[1024] = {0};
    cr_assert_gt(fread(text, 1, sizeof text - 1, f), 0);
    fclose(f);
    cr_assert_null(strstr(text, a + 4), "a key is stored in the clear");
    char h[72];
    cr_assert_eq(km_apikey_hash(a, strlen(a), h, sizeof h), 0);
    cr_assert(strstr(text, h), "%s", text);
    cr_assert(strstr(text, " acme client\n"), "%s", text);
    cr_assert(strstr(text, " ops operator\n"), "%s", text);
}

Test(keys, a_bearer_key_maps_to_its_tenant_and_role)
{
    init_keyfile();
    char a[64], b[64], hdr[128];
    add_key("acme", KM_ROLE_CLIENT, NULL, a);
    add_key("ops", KM_ROLE_OPERATOR, NULL, b);
    km_apikeys *k = keys_open();
    cr_assert_eq(km_apikeys_count(k), 2);
    km_apikey_match m;
    snprintf(hdr, sizeof hdr, "Bearer %s", a);
    cr_assert_eq(km_apikeys_check_header(k, hdr, strlen(hdr), &m), 0);
    cr_assert_str_eq(m.tenant, "acme");
    cr_assert_eq(m.role, KM_ROLE_CLIENT);
    snprintf(hdr, sizeof hdr, "  bEaReR \t %s  ", b);
    cr_assert_eq(km_apikeys_check_header(k, hdr, strlen(hdr), &m), 0);
    cr_assert_str_eq(m.tenant, "ops");
    cr_assert_eq(m.role, KM_ROLE_OPERATOR);
    /* one character off, a prefix, another scheme, nothing */
    char off[64];
    snprintf(off, sizeof off, "%s", a);
    off[10] ^= 1;
    cr_assert_eq(km_apikeys_lookup(k, off, strlen(off), &m), KM_ENOTFOUND);
    cr_assert_str_eq(m.tenant, "");
    cr_assert_eq(km_apikeys_lookup(k, a, strlen(a) - 1, &m), KM_ENOTFOUND);
    const char *bad[] = {"",          "Bearer",        "Bearer ",   "Basic abc",
                         "BearerXYZ", "Bearer a\x01b", "Bearer a b"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        cr_assert_eq(km_apikeys_check_header(k, bad[i], strlen(bad[i]), &m), KM_EFORMAT,
                     "header '%s'", bad[i]);
    cr_assert_eq(km_apikeys_check_header(k, "Bearer nope", 11, &m), KM_ENOTFOUND);
    km_apikeys_close(k);
}

Test(keys, keys_are_added_and_revoked_without_a_restart)
{
    init_keyfile();
    km_apikeys *k = keys_open();
    km_apikey_match m;
    cr_assert_eq(km_apikeys_count(k), 0, "no file: no key is valid");
    char a[64], b[64];
    add_key("acme", KM_ROLE_CLIENT, NULL, a);
    cr_assert_eq(km_apikeys_lookup(k, a, strlen(a), &m), 0);
    add_key("beta", KM_ROLE_CLIENT, NULL, b);
    cr_assert_eq(km_apikeys_lookup(k, b, strlen(b), &m), 0);
    km_errbuf err = {{0}};
    cr_assert_eq(km_apikeys_remove(keyfile, "acme", &err), 1);
    cr_assert_eq(km_apikeys_lookup(k, a, strlen(a), &m), KM_ENOTFOUND, "revoked key still works");
    cr_assert_eq(km_apikeys_lookup(k, b, strlen(b), &m), 0);
    cr_assert_eq(km_apikeys_remove(keyfile, "nobody", &err), 0);
    unlink(keyfile);
    cr_assert_eq(km_apikeys_lookup(k, b, strlen(b), &m), KM_ENOTFOUND, "deleted file, key works");
    km_apikeys_close(k);
}

Test(keys, bad_lines_are_skipped_and_good_ones_still_load)
{
    init_keyfile();
    char a[64];
    add_key("acme", KM_ROLE_CLIENT, NULL, a);
    FILE *f = fopen(keyfile, "a");
    fputs("# a comment\n\n   \n", f);
    fputs("garbage\n", f);
    fputs("b2:00 acme client\n", f);
    fputs("b2:0000000000000000000000000000000000000000000000000000000000000000 acme member\n", f);
    fputs("b2:0000000000000000000000000000000000000000000000000000000000000000 ../x client\n", f);
    fputs("b2:0000000000000000000000000000000000000000000000000000000000000000 x client pepper\n",
          f);
    for (int i = 0; i < 600; i++) fputc('x', f);
    fputs("\n", f);
    fclose(f);
    km_apikeys *k = keys_open();
    cr_assert_eq(km_apikeys_count(k), 1);
    km_apikey_match m;
    cr_assert_eq(km_apikeys_lookup(k, a, strlen(a), &m), 0);
    km_apikeys_close(k);
}

Test(keys, each_key_gets_its_own_cache_salt_unless_one_is_shared_on_purpose)
{
    init_keyfile();
    char a1[64], a2[64], s1[64], s2[64];
    add_key("acme", KM_ROLE_CLIENT, NULL, a1);
    add_key("acme", KM_ROLE_CLIENT, NULL, a2);
    add_key("team1", KM_ROLE_CLIENT, "shared-team", s1);
    add_key("team2", KM_ROLE_CLIENT, "shared-team", s2);
    km_apikeys *k = keys_open();
    km_apikey_match m1, m2, t1, t2, again;
    cr_assert_eq(km_apikeys_lookup(k, a1, strlen(a1), &m1), 0);
    cr_assert_eq(km_apikeys_lookup(k, a2, strlen(a2), &m2), 0);
    cr_assert_str_neq(m1.salt, m2.salt, "two keys share a cache");
    cr_assert_eq(km_apikeys_lookup(k, s1, strlen(s1), &t1), 0);
    cr_assert_eq(km_apikeys_lookup(k, s2, strlen(s2), &t2), 0);
    cr_assert_str_eq(t1.salt, t2.salt);
    cr_assert_str_neq(t1.salt, m1.salt);
    km_apikeys_close(k);
    k = keys_open(); /* stable across reloads and restarts */
    cr_assert_eq(km_apikeys_lookup(k, a1, strlen(a1), &again), 0);
    cr_assert_str_eq(again.salt, m1.salt);
    km_apikeys_close(k);
}

Test(keys, no_unkeyed_request_can_name_a_keyed_tenants_cache)
{
    km_apikey_match m = {.tenant = "acme", .role = KM_ROLE_CLIENT, .salt = "k:0123abcd"};
    char keyed[128], mine[128], unkeyed[128];
    cr_assert_gt(km_cache_salt_compose(&m, NULL, keyed, sizeof keyed), 0);
    cr_assert_str_eq(keyed, "kvmesh:t:k:0123abcd");
    cr_assert_gt(km_cache_salt_compose(&m, "conv-7", mine, sizeof mine), 0);
    cr_assert_str_eq(mine, "kvmesh:t:k:0123abcd/conv-7");
    /* unkeyed requests keep their salt (unchanged hashes for open clusters)... */
    cr_assert_eq(km_cache_salt_compose(NULL, "abc", unkeyed, sizeof unkeyed), 3);
    cr_assert_str_eq(unkeyed, "abc");
    cr_assert_eq(km_cache_salt_compose(NULL, NULL, unkeyed, sizeof unkeyed), 0);
    /* ...but one that spells a keyed tenant's salt is moved out of that namespace */
    cr_assert_gt(km_cache_salt_compose(NULL, keyed, unkeyed, sizeof unkeyed), 0);
    cr_assert_str_neq(unkeyed, keyed);
    cr_assert(!strncmp(unkeyed, "kvmesh:u:", 9));
    char tiny[8];
    cr_assert_eq(km_cache_salt_compose(&m, NULL, tiny, sizeof tiny), KM_ENOSPC);
}

/* The worker's fair share counts a keyed salt's tenant whatever the request added to it. */
Test(keys, a_salts_tenant_is_its_keys_namespace_not_the_requests_own_part)
{
    km_apikey_match m = {.tenant = "acme", .role = KM_ROLE_CLIENT, .salt = "k:0123abcd"};
    km_apikey_match o = {.tenant = "other", .role = KM_ROLE_CLIENT, .salt = "k:4567ef01"};
    char plain[128], narrowed[128], other[128], unkeyed[128];
    cr_assert_gt(km_cache_salt_compose(&m, NULL, plain, sizeof plain), 0);
    cr_assert_gt(km_cache_salt_compose(&m, "conv-7", narrowed, sizeof narrowed), 0);
    cr_assert_gt(km_cache_salt_compose(&o, NULL, other, sizeof other), 0);
    cr_assert_gt(km_cache_salt_compose(NULL, plain, unkeyed, sizeof unkeyed), 0);
    uint64_t t = km_cache_salt_tenant(plain);
    cr_assert_neq(t, 0);
    cr_assert_eq(km_cache_salt_tenant(narrowed), t, "the request's own salt is not a tenant");
    cr_assert_neq(km_cache_salt_tenant(other), t);
    /* everyone unkeyed is one tenant, whatever salt it names */
    cr_assert_eq(km_cache_salt_tenant(unkeyed), 0);
    cr_assert_eq(km_cache_salt_tenant("abc"), 0);
    cr_assert_eq(km_cache_salt_tenant(NULL), 0);
}

/* ---------------------------------------------------------------- cluster secret and MAC */

Test(keys, the_cluster_secret_is_0600_and_a_readable_one_is_refused)
{
    km_errbuf err = {{0}};
    must(km_keydir_init(dir, &err), &err);
    char p[256], q[256];
    snprintf(p, sizeof p, "%s/cluster.secret", dir);
    cr_assert_eq(km_secret_generate_file(p, &err), KM_EINVAL, "overwrote a secret");
    uint8_t s[KM_SECRET_BYTES];
    must(km_secret_load(p, s, &err), &err);
    chmod(p, 0644);
    cr_assert_eq(km_secret_load(p, s, &err), KM_EINVAL);
    cr_assert(strstr(err.msg, "chmod 600"), "%s", err.msg);
    snprintf(q, sizeof q, "%s/bad.secret", dir);
    write_text(q, "not hex at all\n");
    chmod(q, 0600);
    cr_assert_eq(km_secret_load(q, s, &err), KM_EFORMAT);
    write_text(q, "00112233\n");
    cr_assert_eq(km_secret_load(q, s, &err), KM_EFORMAT);
}

Test(keys, derived_keys_and_macs)
{
    uint8_t secret[KM_SECRET_BYTES], other[KM_SECRET_BYTES], k1[32], k2[32], k3[32], k1b[32];
    memset(secret, 7, sizeof secret);
    memset(other, 8, sizeof other);
    km_secret_derive(secret, "kvmpage1", 1, k1);
    km_secret_derive(secret, "kvmpage1", 1, k1b);
    km_secret_derive(secret, "kvmpage1", 2, k2);
    km_secret_derive(other, "kvmpage1", 1, k3);
    cr_assert_arr_eq(k1, k1b, 32);
    cr_assert_arr_neq(k1, k2, 32);
    cr_assert_arr_neq(k1, k3, 32);
    uint8_t data[1000], tag[KM_MAC_BYTES];
    for (int i = 0; i < 1000; i++) data[i] = (uint8_t)(i * 31);
    km_mac(k1, data, sizeof data, tag);
    cr_assert_eq(km_mac_verify(k1, data, sizeof data, tag), 0);
    cr_assert_eq(km_mac_verify(k2, data, sizeof data, tag), KM_ECORRUPT);
    data[500] ^= 1;
    cr_assert_eq(km_mac_verify(k1, data, sizeof data, tag), KM_ECORRUPT);
    data[500] ^= 1;
    tag[0] ^= 0x80;
    cr_assert_eq(km_mac_verify(k1, data, sizeof data, tag), KM_ECORRUPT);
}
