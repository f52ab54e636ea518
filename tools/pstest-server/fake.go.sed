# Applied by tools/build.sh to cloud.google.com/go/pubsub/v2/pstest/fake.go (a vendored copy in
# the build directory, never the module cache or the repo).
#
# 1. A message that reached maxDeliveryAttempts is "acked" with its message id as the ack id,
#    which ack() ignores as an old ack id ("m0" != "m0:5"): the message stays and is published to
#    the dead-letter topic again on every delivery pass. Remove it from the subscription instead.
s/^\t\t\ts\.ack(id)$/\t\t\t(*m.acks)++\n\t\t\tdelete(s.msgs, id)/
# 2. Pending: the unacknowledged messages of a subscription (outstanding or not), for the admin
#    shim's /pstest/pending.
$a\
\
// Pending is the number of unacknowledged messages of a subscription, -1 if there is none\
// (added by deadletter-operator's tools/pstest-server/fake.go.sed).\
func (s *Server) Pending(name string) int {\
	s.GServer.mu.Lock()\
	defer s.GServer.mu.Unlock()\
	sub, ok := s.GServer.subs[name]\
	if !ok {\
		return -1\
	}\
	return len(sub.msgs)\
}
