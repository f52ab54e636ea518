// cesender posts CloudEvents to the park endpoint with the CloudEvents Go SDK, the way a
// Knative sender or any SDK user would: binary or structured mode (or a batch), a bearer
// token, N copies of the same event at once, and prints each copy's HTTP status.
//
//	cesender -url https://127.0.0.1:8443/v1/namespaces/ns/queues/q -ca ca.pem -token-file t \
//	  -mode binary -id e-1 -source /s -type t -data '{"a":1}' -copies 2
//
// With -retry-for, a copy answered 429 or 503 is sent again after Retry-After until it is
// taken or the time is up (a sender that keeps its event under backpressure).
package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"
)

type exts []string

func (e *exts) String() string     { return strings.Join(*e, ",") }
func (e *exts) Set(v string) error { *e = append(*e, v); return nil }

func main() {
	url := flag.String("url", "", "the queue's park URL")
	caFile := flag.String("ca", "", "PEM CA to trust (default: system roots)")
	tokenFile := flag.String("token-file", "", "file holding a bearer token (none: no Authorization)")
	mode := flag.String("mode", "binary", "binary | structured | batch")
	id := flag.String("id", "e-1", "event id")
	source := flag.String("source", "/cesender", "event source")
	typ := flag.String("type", "dev.dlq.test", "event type")
	data := flag.String("data", `{"hello":"world"}`, "event data (JSON)")
	dataSize := flag.Int("data-size", 0, "instead of -data: a JSON string of this many bytes")
	copies := flag.Int("copies", 1, "copies of the event sent at once")
	events := flag.Int("events", 1, "distinct events (ids id-0..id-N-1) per copy; 1 keeps -id")
	retryFor := flag.Duration("retry-for", 0, "keep retrying 429/503 answers this long")
	var ext exts
	flag.Var(&ext, "ext", "extension attribute name=value (repeatable)")
	flag.Parse()
	if *url == "" {
		fmt.Fprintln(os.Stderr, "cesender: -url is required")
		os.Exit(2)
	}

	transport := &http.Transport{MaxIdleConnsPerHost: 64, ForceAttemptHTTP2: false}
	if *caFile != "" {
		pem, err := os.ReadFile(*caFile)
		if err != nil {
			fail(err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			fail(fmt.Errorf("%s holds no PEM certificate", *caFile))
		}
		transport.TLSClientConfig = &tls.Config{RootCAs: pool}
	}
	hc := &http.Client{Transport: transport, Timeout: 30 * time.Second}
	token := ""
	if *tokenFile != "" {
		b, err := os.ReadFile(*tokenFile)
		if err != nil {
			fail(err)
		}
		token = strings.TrimSpace(string(b))
	}
	opts := []cehttp.Option{cehttp.WithTarget(*url), cehttp.WithClient(*hc)}
	if token != "" {
		opts = append(opts, cehttp.WithHeader("Authorization", "Bearer "+token))
	}
	p, err := cloudevents.NewHTTP(opts...)
	if err != nil {
		fail(err)
	}
	client, err := cloudevents.NewClient(p, cloudevents.WithTimeNow())
	if err != nil {
		fail(err)
	}

	payload := []byte(*data)
	if *dataSize > 0 {
		payload, _ = json.Marshal(strings.Repeat("x", *dataSize))
	}
	build := func(n int) cloudevents.Event {
		e := cloudevents.NewEvent()
		e.SetID(*id)
		if *events > 1 {
			e.SetID(fmt.Sprintf("%s-%d", *id, n))
		}
		e.SetSource(*source)
		e.SetType(*typ)
		// A fixed time: copies of one event are the very same event.
		e.SetTime(time.Unix(1764763200, 0).UTC())
		for _, kv := range ext {
			k, v, _ := strings.Cut(kv, "=")
			e.SetExtension(k, v)
		}
		if err := e.SetData(cloudevents.ApplicationJSON, payload); err != nil {
			fail(err)
		}
		return e
	}

	send := func(e cloudevents.Event) (int, time.Duration) {
		switch *mode {
		case "binary", "structured":
			ctx := context.Background()
			if *mode == "structured" {
				ctx = cloudevents.WithEncodingStructured(ctx)
			}
			res := client.Send(ctx, e)
			var hr *cehttp.Result
			if cloudevents.ResultAs(res, &hr) {
				return hr.StatusCode, time.Second
			}
			if cloudevents.IsACK(res) {
				return 200, 0
			}
			fmt.Fprintf(os.Stderr, "cesender: %v\n", res)
			return 0, time.Second
		case "batch":
			body, err := json.Marshal([]cloudevents.Event{e})
			if err != nil {
				fail(err)
			}
			req, _ := http.NewRequest(http.MethodPost, *url, bytes.NewReader(body))
			req.Header.Set("Content-Type", "application/cloudevents-batch+json")
			if token != "" {
				req.Header.Set("Authorization", "Bearer "+token)
			}
			resp, err := hc.Do(req)
			if err != nil {
				fmt.Fprintf(os.Stderr, "cesender: %v\n", err)
				return 0, time.Second
			}
			defer resp.Body.Close()
			wait := time.Second
			if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil {
				wait = time.Duration(s) * time.Second
			}
			return resp.StatusCode, wait
		default:
			fail(fmt.Errorf("unknown -mode %q", *mode))
		}
		return 0, 0
	}

	var mu sync.Mutex
	codes := map[int]int{}
	var wg sync.WaitGroup
	start := time.Now()
	for c := 0; c < *copies; c++ {
		wg.Add(1)
		go func(c int) {
			defer wg.Done()
			for n := 0; n < *events; n++ {
				e := build(n)
				deadline := time.Now().Add(*retryFor)
				attempts := 0
				var code int
				for {
					var wait time.Duration
					code, wait = send(e)
					attempts++
					if (code == 429 || code == 503 || code == 0) && time.Now().Before(deadline) {
						time.Sleep(wait)
						continue
					}
					break
				}
				mu.Lock()
				codes[code]++
				if *events == 1 {
					fmt.Printf("copy=%d status=%d attempts=%d\n", c, code, attempts)
				}
				mu.Unlock()
			}
		}(c)
	}
	wg.Wait()
	keys := make([]int, 0, len(codes))
	for k := range codes {
		keys = append(keys, k)
	}
	sort.Ints(keys)
	parts := []string{}
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%d=%d", k, codes[k]))
	}
	fmt.Printf("codes %s seconds=%.3f\n", strings.Join(parts, " "), time.Since(start).Seconds())
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "cesender: %v\n", err)
	os.Exit(1)
}
