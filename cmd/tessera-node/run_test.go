package main

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/tessera-gpu/tessera/internal/podresources"
)

// periodic checks, on a synctest bubble's clock, the schedule of a loop that run starts: it calls
// nothing before one period has passed (run did the first itself), then once a period, going on
// after a failure, and it returns once ctx ends. start runs the loop with the period, its calls
// failing with fail (each or some); calls counts the calls made.
func periodic(t *testing.T, period time.Duration, start func(ctx context.Context, fail error), calls func() int) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel() // a failed check leaves no loop behind in the bubble
		done := make(chan struct{})
		go func() { defer close(done); start(ctx, errors.New("kubelet gone")) }()
		synctest.Wait()
		if n := calls(); n != 0 {
			t.Fatalf("%d calls before the first period passed, want none", n)
		}
		time.Sleep(period / 2)
		for want := 1; want <= 3; want++ {
			time.Sleep(period)
			synctest.Wait()
			if n := calls(); n != want {
				t.Fatalf("%d calls after %d periods (failures among them), want %d", n, want, want)
			}
		}
		cancel()
		<-done
	})
}

// TestRediscoverSchedule: GPUs are rediscovered once a rediscover interval, the first an interval
// after start, a failed refresh does not stop the loop, and the loop ends with its context.
func TestRediscoverSchedule(t *testing.T) {
	var n atomic.Int64 // synctest.Wait orders nothing for the race detector
	periodic(t, time.Minute, func(ctx context.Context, fail error) {
		rediscover(ctx, func(context.Context) error { n.Add(1); return fail }, time.Minute, testLog(t))
	}, func() int { return int(n.Load()) })
}

// TestReleaseUnlistedSchedule: the kubelet's pods are listed once an unlistedInterval, the first an
// interval after start; a failed list releases nothing and the next is tried; the loop ends with
// its context.
func TestReleaseUnlistedSchedule(t *testing.T) {
	var lists, releases atomic.Int64
	periodic(t, unlistedInterval, func(ctx context.Context, fail error) {
		list := func(context.Context) (map[podresources.Key]podresources.Grant, error) {
			if lists.Add(1)%2 == 1 {
				return nil, fail
			}
			return map[podresources.Key]podresources.Grant{}, nil
		}
		release := func(context.Context, map[podresources.Key]podresources.Grant) { releases.Add(1) }
		releaseUnlisted(ctx, list, release, unlistedInterval, testLog(t))
	}, func() int { return int(lists.Load()) })
	if releases.Load() != 1 {
		t.Errorf("%d releases after 3 lists of which the first and third failed, want 1", releases.Load())
	}
}
