// pstest-server runs Google's in-process Pub/Sub server (cloud.google.com/go/pubsub/v2/pstest:
// the gRPC API with dead-letter policies, ordering keys, streaming pull) on a loopback port for
// deadletter-operator's tests, with a small JSON admin shim on a second loopback port. The tests
// and the operator speak gRPC to -grpc-port (PUBSUB_EMULATOR_HOST); the shim saves the tests a
// Pub/Sub client of their own for setup and for playing a failing worker.
//
// The gRPC port also answers the one REST call the operator makes (Google's Rust client speaks
// REST for administration): GET /v1/projects/P/subscriptions/S (the subscription's topic) and
// GET /v1/projects/P/topics/T (the target's Ready probe). A
// connection opening with the HTTP/2 preface goes to pstest's gRPC server; any other is REST.
//
//	pstest-server -grpc-port N -admin-port M [-closed]
//
// Admin shim (POST bodies and answers are JSON; data is base64, as encoding/json writes []byte):
//
//	POST /topics        {"name"}
//	POST /subscriptions {"name","topic","deadLetterTopic","maxDeliveryAttempts","ackDeadlineSeconds","enableMessageOrdering"}
//	POST /publish       {"topic","messages":[{"data","attributes","orderingKey"}]} -> {"messageIds"}
//	POST /pull          {"subscription","max"} -> {"messages":[{"ackId","messageId","data","attributes","orderingKey","deliveryAttempt"}]}
//	POST /ack           {"subscription","ackIds"}
//	POST /nack          {"subscription","ackIds"}   (ack deadline 0: redelivered at once)
//	GET  /pstest/pending?subscription=S -> {"pending": n}   (unacknowledged, outstanding or not)
//	POST /open                                   (with -closed: only now the gRPC port listens)
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"

	pb "cloud.google.com/go/pubsub/v2/apiv1/pubsubpb"
	"cloud.google.com/go/pubsub/v2/pstest"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

// peeked is a connection whose first bytes were read to route it.
type peeked struct {
	net.Conn
	r *bufio.Reader
}

func (c peeked) Read(b []byte) (int, error) { return c.r.Read(b) }

// connListener hands routed connections to an http.Server.
type connListener struct {
	conns chan net.Conn
	addr  net.Addr
}

func (l connListener) Accept() (net.Conn, error) { return <-l.conns, nil }
func (l connListener) Close() error              { return nil }
func (l connListener) Addr() net.Addr            { return l.addr }

// serveGrpcAndRest routes each connection of ln: HTTP/2 (gRPC) to the pstest server at
// grpcAddr, anything else to rest.
func serveGrpcAndRest(ln net.Listener, grpcAddr string, rest http.Handler) {
	restLn := connListener{conns: make(chan net.Conn), addr: ln.Addr()}
	go func() { log.Fatal(http.Serve(restLn, rest)) }()
	for {
		c, err := ln.Accept()
		if err != nil {
			log.Fatalf("accept: %v", err)
		}
		go func() {
			r := bufio.NewReader(c)
			head, err := r.Peek(3)
			if err != nil {
				_ = c.Close()
				return
			}
			conn := peeked{c, r}
			if string(head) != "PRI" {
				restLn.conns <- conn
				return
			}
			up, err := net.Dial("tcp", grpcAddr)
			if err != nil {
				_ = c.Close()
				return
			}
			go func() { _, _ = io.Copy(up, conn); _ = up.Close() }()
			_, _ = io.Copy(c, up)
			_ = c.Close()
		}()
	}
}

type message struct {
	AckID           string            `json:"ackId,omitempty"`
	MessageID       string            `json:"messageId,omitempty"`
	Data            []byte            `json:"data"`
	Attributes      map[string]string `json:"attributes,omitempty"`
	OrderingKey     string            `json:"orderingKey,omitempty"`
	DeliveryAttempt int32             `json:"deliveryAttempt,omitempty"`
}

func main() {
	grpcPort := flag.Int("grpc-port", 8085, "loopback port of the Pub/Sub gRPC API")
	adminPort := flag.Int("admin-port", 8086, "loopback port of the JSON admin shim")
	closed := flag.Bool("closed", false, "open the gRPC port only on POST /open (declare topics and subscriptions first)")
	flag.Parse()

	srv := pstest.NewServerWithAddress("127.0.0.1:0")
	g := &srv.GServer
	ctx := context.Background()

	rest := http.NewServeMux()
	answer := func(w http.ResponseWriter, m proto.Message, err error) {
		w.Header().Set("content-type", "application/json")
		if err != nil {
			st := status.Convert(err)
			w.WriteHeader(http.StatusNotFound)
			_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{
				"code": 404, "message": st.Message(), "status": "NOT_FOUND"}})
			return
		}
		out, _ := protojson.Marshal(m)
		_, _ = w.Write(out)
	}
	rest.HandleFunc("GET /v1/projects/{project}/subscriptions/{sub}", func(w http.ResponseWriter, r *http.Request) {
		name := fmt.Sprintf("projects/%s/subscriptions/%s", r.PathValue("project"), r.PathValue("sub"))
		sub, err := g.GetSubscription(r.Context(), &pb.GetSubscriptionRequest{Subscription: name})
		answer(w, sub, err)
	})
	rest.HandleFunc("GET /v1/projects/{project}/topics/{topic}", func(w http.ResponseWriter, r *http.Request) {
		name := fmt.Sprintf("projects/%s/topics/%s", r.PathValue("project"), r.PathValue("topic"))
		t, err := g.GetTopic(r.Context(), &pb.GetTopicRequest{Topic: name})
		answer(w, t, err)
	})
	var opened sync.Once
	open := func() {
		opened.Do(func() {
			public, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", *grpcPort))
			if err != nil {
				log.Fatalf("gRPC listener: %v", err)
			}
			log.Printf("pstest gRPC (and REST) on %s via %s", public.Addr(), srv.Addr)
			go serveGrpcAndRest(public, srv.Addr, rest)
		})
	}
	if !*closed {
		open()
	}

	mux := http.NewServeMux()
	handle := func(path string, f func(r *http.Request) (any, error)) {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			out, err := f(r)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			if out == nil {
				out = struct{}{}
			}
			w.Header().Set("content-type", "application/json")
			_ = json.NewEncoder(w).Encode(out)
		})
	}
	decode := func(r *http.Request, v any) error { return json.NewDecoder(r.Body).Decode(v) }

	handle("POST /topics", func(r *http.Request) (any, error) {
		var req struct{ Name string }
		if err := decode(r, &req); err != nil {
			return nil, err
		}
		_, err := g.CreateTopic(ctx, &pb.Topic{Name: req.Name})
		return nil, err
	})
	handle("POST /subscriptions", func(r *http.Request) (any, error) {
		var req struct {
			Name, Topic, DeadLetterTopic string
			MaxDeliveryAttempts          int32
			AckDeadlineSeconds           int32
			EnableMessageOrdering        bool
		}
		if err := decode(r, &req); err != nil {
			return nil, err
		}
		sub := &pb.Subscription{
			Name:                  req.Name,
			Topic:                 req.Topic,
			AckDeadlineSeconds:    req.AckDeadlineSeconds,
			EnableMessageOrdering: req.EnableMessageOrdering,
		}
		if req.DeadLetterTopic != "" {
			sub.DeadLetterPolicy = &pb.DeadLetterPolicy{
				DeadLetterTopic:     req.DeadLetterTopic,
				MaxDeliveryAttempts: req.MaxDeliveryAttempts,
			}
		}
		_, err := g.CreateSubscription(ctx, sub)
		return nil, err
	})
	handle("POST /publish", func(r *http.Request) (any, error) {
		var req struct {
			Topic    string
			Messages []message
		}
		if err := decode(r, &req); err != nil {
			return nil, err
		}
		pr := &pb.PublishRequest{Topic: req.Topic}
		for _, m := range req.Messages {
			pr.Messages = append(pr.Messages, &pb.PubsubMessage{
				Data: m.Data, Attributes: m.Attributes, OrderingKey: m.OrderingKey,
			})
		}
		resp, err := g.Publish(ctx, pr)
		if err != nil {
			return nil, err
		}
		return map[string][]string{"messageIds": resp.MessageIds}, nil
	})
	handle("POST /pull", func(r *http.Request) (any, error) {
		var req struct {
			Subscription string
			Max          int32
		}
		if err := decode(r, &req); err != nil {
			return nil, err
		}
		if req.Max <= 0 {
			req.Max = 100
		}
		resp, err := g.Pull(ctx, &pb.PullRequest{Subscription: req.Subscription, MaxMessages: req.Max})
		if err != nil {
			return nil, err
		}
		out := []message{}
		for _, rm := range resp.ReceivedMessages {
			m := rm.Message
			out = append(out, message{
				AckID: rm.AckId, MessageID: m.MessageId, Data: m.Data, Attributes: m.Attributes,
				OrderingKey: m.OrderingKey, DeliveryAttempt: rm.DeliveryAttempt,
			})
		}
		return map[string][]message{"messages": out}, nil
	})
	ids := func(r *http.Request) (string, []string, error) {
		var req struct {
			Subscription string
			AckIds       []string
		}
		err := decode(r, &req)
		return req.Subscription, req.AckIds, err
	}
	handle("POST /ack", func(r *http.Request) (any, error) {
		sub, ackIDs, err := ids(r)
		if err != nil {
			return nil, err
		}
		_, err = g.Acknowledge(ctx, &pb.AcknowledgeRequest{Subscription: sub, AckIds: ackIDs})
		return nil, err
	})
	handle("POST /nack", func(r *http.Request) (any, error) {
		sub, ackIDs, err := ids(r)
		if err != nil {
			return nil, err
		}
		_, err = g.ModifyAckDeadline(ctx, &pb.ModifyAckDeadlineRequest{Subscription: sub, AckIds: ackIDs})
		return nil, err
	})
	handle("GET /pstest/pending", func(r *http.Request) (any, error) {
		sub := r.URL.Query().Get("subscription")
		n := srv.Pending(sub)
		if n < 0 {
			return nil, fmt.Errorf("no subscription %q", sub)
		}
		return map[string]int{"pending": n}, nil
	})

	// After a restart the tests declare the topics and subscriptions before the operator can
	// publish: a message published to a topic without its subscription reaches no one.
	handle("POST /open", func(r *http.Request) (any, error) {
		open()
		return map[string]bool{"open": true}, nil
	})

	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", *adminPort))
	if err != nil {
		log.Fatalf("admin listener: %v", err)
	}
	go func() { log.Fatal(http.Serve(ln, mux)) }()
	log.Printf("pstest admin on %s", ln.Addr())

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	_ = srv.Close()
}
