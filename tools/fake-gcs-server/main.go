// Command fake-gcs-server serves fsouza's fake-gcs-server (its fakestorage package, the version
// go.mod pins) on plain HTTP, plus the one call object_store's GCS client makes that upstream
// does not serve: the XML API's object upload, `PUT /<bucket>/<object>` on the public host
// (fake-gcs-server issue #331; its PR #1164 is unmerged, and upstream answers such a PUT
// "400 invalid uploadType"). That PUT is served as fakestorage's own JSON API media upload of
// the same bytes (`POST /upload/storage/v1/b/<bucket>/o?uploadType=media&name=<object>`: the
// same bucket check, digests and generations), answered as the XML API answers: an empty body
// with ETag, x-goog-generation and x-goog-hash. Every other request goes to fakestorage
// unchanged (its XML API GET, HEAD, DELETE and list included).
//
// Used by the body-store tests (crates/dlq-testenv/src/brokers/gcs.rs); built by
// tools/build.sh fake-gcs-server.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strconv"
	"strings"

	"github.com/fsouza/fake-gcs-server/fakestorage"
)

func main() {
	host := flag.String("host", "127.0.0.1", "address to bind to")
	port := flag.Uint("port", 4443, "port to bind to")
	publicHost := flag.String("public-host", "", "host:port of the XML API (default: the bound host:port)")
	root := flag.String("filesystem-root", "", "directory of the filesystem backend (empty: in memory)")
	flag.Parse()
	addr := net.JoinHostPort(*host, strconv.FormatUint(uint64(*port), 10))
	if *publicHost == "" {
		*publicHost = addr
	}
	srv, err := fakestorage.NewServerWithOptions(fakestorage.Options{
		StorageRoot: *root,
		Scheme:      "http",
		Host:        *host,
		Port:        uint16(*port),
		NoListener:  true,
		ExternalURL: "http://" + addr,
		PublicHost:  *publicHost,
		Writer:      os.Stderr,
	})
	if err != nil {
		log.Fatalf("fake-gcs-server: %v", err)
	}
	handler := srv.HTTPHandler()
	listener, err := net.Listen("tcp", addr)
	if err != nil {
		log.Fatalf("fake-gcs-server: %v", err)
	}
	log.Printf("fake-gcs-server listening on http://%s (XML API host %s)", addr, *publicHost)
	log.Fatal(http.Serve(listener, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if bucket, object, ok := xmlUpload(r, *publicHost); ok {
			serveXMLUpload(handler, w, r, bucket, object)
			return
		}
		handler.ServeHTTP(w, r)
	})))
}

// xmlUpload reports whether r is an XML API object upload: a PUT to /<bucket>/<object> on the
// public host, not one of the JSON API's paths, not a signed-URL or resumable upload.
func xmlUpload(r *http.Request, publicHost string) (bucket, object string, ok bool) {
	if r.Method != http.MethodPut || r.Host != publicHost {
		return "", "", false
	}
	q := r.URL.Query()
	if q.Has("uploadType") || q.Has("upload_id") || q.Has("X-Goog-Algorithm") {
		return "", "", false
	}
	path := r.URL.EscapedPath()
	for _, api := range []string{"/storage/", "/upload/", "/download/", "/batch/", "/_internal/"} {
		if strings.HasPrefix(path, api) {
			return "", "", false
		}
	}
	b, o, found := strings.Cut(strings.TrimPrefix(path, "/"), "/")
	if !found || b == "" || o == "" {
		return "", "", false
	}
	var err error
	if bucket, err = url.PathUnescape(b); err != nil {
		return "", "", false
	}
	if object, err = url.PathUnescape(o); err != nil {
		return "", "", false
	}
	return bucket, object, true
}

// serveXMLUpload runs the upload as fakestorage's JSON media upload and answers as the XML API.
func serveXMLUpload(handler http.Handler, w http.ResponseWriter, r *http.Request, bucket, object string) {
	query := url.Values{"uploadType": {"media"}, "name": {object}}
	// The XML API's preconditions are headers; the JSON API's, query parameters.
	for header, param := range map[string]string{
		"X-Goog-If-Generation-Match":     "ifGenerationMatch",
		"X-Goog-If-Metageneration-Match": "ifMetagenerationMatch",
	} {
		if v := r.Header.Get(header); v != "" {
			query.Set(param, v)
		}
	}
	inner := r.Clone(r.Context())
	inner.Method = http.MethodPost
	inner.URL = &url.URL{
		Path:     "/upload/storage/v1/b/" + bucket + "/o",
		RawPath:  "/upload/storage/v1/b/" + url.PathEscape(bucket) + "/o",
		RawQuery: query.Encode(),
	}
	inner.RequestURI = inner.URL.RequestURI()
	rec := httptest.NewRecorder()
	handler.ServeHTTP(rec, inner)
	if rec.Code != http.StatusOK {
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
		return
	}
	var created struct {
		Etag       string `json:"etag"`
		Generation string `json:"generation"`
		Crc32c     string `json:"crc32c"`
		Md5Hash    string `json:"md5Hash"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &created); err != nil {
		http.Error(w, fmt.Sprintf("reading fakestorage's upload answer: %v", err), http.StatusInternalServerError)
		return
	}
	w.Header().Set("ETag", strconv.Quote(created.Etag))
	w.Header().Set("X-Goog-Generation", created.Generation)
	w.Header().Set("X-Goog-Hash", fmt.Sprintf("crc32c=%s,md5=%s", created.Crc32c, created.Md5Hash))
	w.WriteHeader(http.StatusOK)
}
