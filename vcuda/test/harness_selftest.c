/*
 * harness_selftest: cases that fail on purpose, run only by the Go test
 * TestHarnessReportsDeadChildren (never by the suite): a child that crashes,
 * fails or exits without sending must fail its case at once, naming the
 * child and how it died, not leave the parent blocked until the runner's
 * timeout.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <unistd.h>

#include "util.h"

static int crashes(int i, void *arg) {
    (void)i, (void)arg;
    raise(SIGSEGV);
    return 0;
}
static int says_nothing(int i, void *arg) {
    (void)i, (void)arg;
    return 0;
}
static int fails(int i, void *arg) {
    (void)i, (void)arg;
    return 3;
}
static int waits_for_parent(int i, void *arg) {
    (void)i;
    chan_recv_down(arg);
    return 0;
}

TEST(selftest_child_crashes) {
    chan c;
    chan_init(&c);
    spawn(crashes, 0, &c);
    chan_recv_up(&c);
}

/* Seen as end of file: the parent no longer holds the write end. */
TEST(selftest_child_exits_without_sending) {
    chan c;
    chan_init(&c);
    spawn(says_nothing, 0, &c);
    chan_recv_up(&c);
}

/* A live sibling inherited the write end, so no end of file comes: the
 * parent sees the failed child itself. */
TEST(selftest_sibling_holds_the_pipe) {
    chan a, b;
    chan_init(&a);
    chan_init(&b);
    spawn(fails, 0, &a);
    spawn(waits_for_parent, 1, &b);
    chan_recv_up(&a);
}

TEST(selftest_child_dies_before_its_file) {
    spawn(fails, 0, NULL);
    wait_for_file(tpath("never"), 60); /* longer than the Go test waits */
}

static int sends_late(int i, void *arg) {
    (void)i;
    usleep(200000);
    chan_send_up(arg, 42);
    return 0;
}
static int makes_file_late(int i, void *arg) {
    (void)i, (void)arg;
    usleep(200000);
    write_file(tpath("late"), "");
    return 0;
}

/* No false alarms: a child that exited cleanly and one whose failure was
 * reaped do not fail waits that end normally. */
TEST(selftest_passes) {
    spawn(says_nothing, 0, NULL);
    CHECK(wait_child(spawn(fails, 1, NULL)) == 3, "the reaped failure");
    chan c;
    chan_init(&c);
    spawn(sends_late, 2, &c);
    CHECK(chan_recv_up(&c) == 42, "message");
    spawn(makes_file_late, 3, NULL);
    wait_for_file(tpath("late"), 60);
}

int test_main(int argc, char **argv);
int main(int argc, char **argv) { return test_main(argc, argv); }
